"""The numerics fingerprint: everything that can change the bits a PyTorch program computes.

Two runs may be compared bitwise only when their fingerprints are compatible: every field below
that is not informational must be equal. `incompatibilities(a, b)` names the fields that differ,
so a check can say exactly why it fell back to a tolerance comparison.

Compared fields (they select kernels or change rounding): torch version; device kind and name;
the CPU ISA torch dispatches to and the CPU's SIMD flags (oneDNN and MKL pick kernels by them);
BLAS and oneDNN versions; CUDA, cuDNN and GPU compute capability; intra-op thread count; dtype
policy (default dtype, fp32 matmul precision); deterministic-algorithms and batch-invariant modes;
and the environment variables that steer MKL, oneDNN, OpenBLAS and cuBLAS numerics.

Informational fields (recorded, never compared): python, numpy and titan-audit versions, the
platform string, CPU count, and the thread-count variables a launcher sets (the effective thread
count is compared instead).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FINGERPRINT_VERSION = 1

# Variables that steer kernel choice or rounding. Compared.
NUMERICS_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "OPENBLAS_CORETYPE",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)
# Variables worth seeing but superseded by a compared field (num_threads). Not compared.
INFO_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TRITON_INTERPRET")

# CPU flags that select SIMD kernels (Linux /proc/cpuinfo names).
ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2", "bf16",
)  # fmt: skip


def _compared() -> Any:
    return field(metadata={"compared": True})


@dataclass(frozen=True)
class NumericsFingerprint:
    fingerprint_version: int = _compared()
    torch_version: str = _compared()
    device_kind: str = _compared()
    device_name: str = _compared()
    cpu_capability: str = _compared()
    cpu_isa_flags: tuple[str, ...] = _compared()
    blas: str = _compared()
    onednn: str = _compared()
    cuda_version: str | None = _compared()
    cudnn_version: int | None = _compared()
    gpu_capability: str | None = _compared()
    num_threads: int = _compared()
    default_dtype: str = _compared()
    float32_matmul_precision: str = _compared()
    deterministic_algorithms: bool = _compared()
    batch_invariant: bool = _compared()
    env: dict[str, str | None] = _compared()
    info: dict[str, Any] = field(default_factory=dict, metadata={"compared": False})

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["cpu_isa_flags"] = list(self.cpu_isa_flags)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "fingerprint") -> NumericsFingerprint:
        """Parse a fingerprint written by `to_dict`; errors name `source` and the key at fault."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected an object, got {type(data).__name__}")
        version = data.get("fingerprint_version")
        if not isinstance(version, int):
            raise ValueError(f"{source}: missing or invalid key 'fingerprint_version'")
        if version > FINGERPRINT_VERSION:
            raise ValueError(
                f"{source}: fingerprint_version {version} is newer than this titan-audit "
                f"understands ({FINGERPRINT_VERSION}); upgrade titan-audit"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}")
        missing = sorted(names - set(data) - {"info"})
        if missing:
            raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
        values = dict(data)
        values["cpu_isa_flags"] = tuple(values["cpu_isa_flags"])
        return cls(**values)

    def compared_fields(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("compared")
        }


def incompatibilities(a: NumericsFingerprint, b: NumericsFingerprint) -> list[str]:
    """Why runs with fingerprints a and b cannot be compared bitwise; empty when they can."""
    reasons = []
    fields_a, fields_b = a.compared_fields(), b.compared_fields()
    for name, value_a in fields_a.items():
        value_b = fields_b[name]
        if name == "env":
            for var in sorted(set(value_a) | set(value_b)):
                if value_a.get(var) != value_b.get(var):
                    reasons.append(f"env {var}: {value_a.get(var)!r} != {value_b.get(var)!r}")
        elif value_a != value_b:
            reasons.append(f"{name}: {value_a!r} != {value_b!r}")
    return reasons


def compatible(a: NumericsFingerprint, b: NumericsFingerprint) -> bool:
    return not incompatibilities(a, b)


def fingerprint(device: str | torch.device | None = None) -> NumericsFingerprint:
    """The numerics fingerprint of this process, now, for `device` (default: cuda if present)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    from titan_audit import batch_invariant  # a peer at the bottom layer; imported late on purpose

    static = _static_cpu_facts()
    import titan_audit

    return NumericsFingerprint(
        fingerprint_version=FINGERPRINT_VERSION,
        torch_version=torch.__version__,
        device_kind=device.type,
        device_name=torch.cuda.get_device_name(device) if cuda else static["cpu_name"],
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_isa_flags=static["isa_flags"],
        blas=static["blas"],
        onednn=static["onednn"],
        cuda_version=torch.version.cuda if cuda else None,
        cudnn_version=torch.backends.cudnn.version() if cuda else None,
        gpu_capability="sm_{}{}".format(*torch.cuda.get_device_capability(device)) if cuda else None,
        num_threads=torch.get_num_threads(),
        default_dtype=str(torch.get_default_dtype()).removeprefix("torch."),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        batch_invariant=batch_invariant.is_enabled(),
        env={name: os.environ.get(name) for name in NUMERICS_ENV_VARS},
        info={
            "python": platform.python_version(),
            "numpy": np.__version__,
            "titan_audit": titan_audit.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "env": {name: os.environ.get(name) for name in INFO_ENV_VARS},
        },
    )


@functools.cache
def _static_cpu_facts() -> dict[str, Any]:
    """Facts that cannot change while the process runs (read once: torch's config is slow)."""
    config = torch.__config__.show()
    cpu_name, flags = _read_cpuinfo()
    return {
        "cpu_name": cpu_name,
        "isa_flags": tuple(flag for flag in ISA_FLAGS if flag in flags),
        "blas": _blas_from_config(config),
        "onednn": _search(r"(?:MKL-DNN|oneDNN) (v[\w.]+)", config) or "none",
    }


def _read_cpuinfo() -> tuple[str, set[str]]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine(), set()
    name = _search(r"^model name\s*:\s*(.+)$", text) or _search(r"^Hardware\s*:\s*(.+)$", text)
    flags = _search(r"^(?:flags|Features)\s*:\s*(.+)$", text) or ""
    return (name or platform.machine()).strip(), set(flags.split())


def _blas_from_config(config: str) -> str:
    mkl = _search(r"Math Kernel Library Version ([^\n]+?) for", config)
    if mkl:
        return f"mkl {mkl}"
    info = _search(r"BLAS_INFO=(\w+)", config)
    return info or "unknown"


def _search(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, flags=re.MULTILINE)
    return match.group(1) if match else None
