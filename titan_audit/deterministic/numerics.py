"""The numerics fingerprint: everything that can change the bits a PyTorch program computes.

Two runs may be compared bitwise only when their fingerprints are compatible: every field below
that is not informational must be equal. `incompatibilities(a, b)` names the fields that differ,
so a check can say exactly why it fell back to a tolerance comparison.

Compared fields (they select kernels or change rounding): torch version; device kind and name;
the CPU ISA torch dispatches to and the CPU's SIMD flags (oneDNN and MKL pick kernels by them);
BLAS and oneDNN versions; CUDA, cuDNN and GPU compute capability; intra-op thread count; dtype
policy (default dtype, fp32 matmul precision); deterministic-algorithms and batch-invariant modes;
and the environment variables that steer MKL, oneDNN, OpenBLAS and cuBLAS numerics; on CUDA also
NCCL's algorithm / protocol / channel variables (`NCCL_ENV_VARS`) and, in BI mode, the Triton
release that compiles the kernels (`bi_kernels`; it also names the gemm order, see `_bi_kernels`).

Informational fields (recorded, never compared): python, numpy and titan-audit versions, the
platform string, CPU count, and the thread-count variables a launcher sets (the effective thread
count is compared instead).

Batch-invariant mode on CPU follows the truth: there every op that reduces or evaluates a
transcendental function runs on our own compiled kernels (batch_invariant/cpu/kernels), whose bits
are the same on every CPU and ISA variant (tests/batch_invariant force each variant and every
library knob; tests/golden/kernels.json is checked on every CPU and under qemu-aarch64), and the
remaining torch ops are correctly rounded elementwise ops, gathers and integer work: the op census
(batch_invariant/census.py) sees every other op and records or refuses it. So when both fingerprints
are BI-mode CPU fingerprints, the CPU model, its SIMD flags, ATen's dispatch ISA, the BLAS and
oneDNN versions and the variables that steer them (`BI_CPU_PORTABLE_*`) become informational;
what can still change bits stays compared: the kernel library's version and gemm order
(`bi_kernels`), the torch version (elementwise ops are still torch's), the CPU architecture
(`arch`: another architecture runs other torch elementwise code), the thread count, dtype policy
and the modes.
`fingerprint_version` names the file format and is not compared; version 1 files (no `arch`,
no `bi_kernels`) read as `arch` unknown, `bi_kernels` None.
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

FINGERPRINT_VERSION = 2

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
# NCCL's reduction order (deterministic.switches.NCCL_ENV): compared, recorded for CUDA fingerprints
# only (a CPU run reduces over gloo, and CPU fingerprints keep the keys they always had).
NCCL_ENV_VARS = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
)
# Variables worth seeing but superseded by a compared field (num_threads). Not compared.
INFO_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TRITON_INTERPRET",
    "TITAN_AUDIT_CPU_ISA",
    "LD_PRELOAD",  # e.g. scripts/mkl_intel_path.c, which moves MKL (native ops) onto its Intel paths
)

# CPU flags that select SIMD kernels (Linux /proc/cpuinfo names).
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
)


def _compared(*, bi_cpu_portable: bool = False) -> Any:
    return field(metadata={"compared": True, "bi_cpu_portable": bi_cpu_portable})


# Fields and variables that cannot change a BI-mode CPU result (see the module doc).
BI_CPU_PORTABLE_ENV_VARS = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "OPENBLAS_CORETYPE",
)


@dataclass(frozen=True)
class NumericsFingerprint:
    fingerprint_version: int = field(metadata={"compared": False})
    torch_version: str = _compared()
    device_kind: str = _compared()
    device_name: str = _compared(bi_cpu_portable=True)
    cpu_capability: str = _compared(bi_cpu_portable=True)
    cpu_isa_flags: tuple[str, ...] = _compared(bi_cpu_portable=True)
    blas: str = _compared(bi_cpu_portable=True)
    onednn: str = _compared(bi_cpu_portable=True)
    cuda_version: str | None = _compared()
    cudnn_version: int | None = _compared()
    gpu_capability: str | None = _compared()
    num_threads: int = _compared()
    default_dtype: str = _compared()
    float32_matmul_precision: str = _compared()
    deterministic_algorithms: bool = _compared()
    batch_invariant: bool = _compared()
    env: dict[str, str | None] = _compared()
    arch: str | None = field(default=None, metadata={"compared": True})  # None: a version-1 file
    bi_kernels: str | None = field(default=None, metadata={"compared": True})
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
        optional = {"info"} | ({"arch", "bi_kernels"} if version == 1 else set())
        missing = sorted(names - set(data) - optional)
        if missing:
            raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")
        values = dict(data)
        values["cpu_isa_flags"] = tuple(values["cpu_isa_flags"])
        return cls(**values)

    @property
    def bi_cpu(self) -> bool:
        """A batch-invariant-mode CPU fingerprint (our kernels: portable across CPUs)."""
        return self.batch_invariant and self.device_kind == "cpu"

    def compared_fields(self, *, portable: bool = False) -> dict[str, Any]:
        """The fields that must match; `portable`: as between two BI-mode CPU fingerprints."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata.get("compared") and not (portable and f.metadata.get("bi_cpu_portable"))
        }
        if portable:
            out["env"] = {k: v for k, v in self.env.items() if k not in BI_CPU_PORTABLE_ENV_VARS}
        return out


def incompatibilities(a: NumericsFingerprint, b: NumericsFingerprint) -> list[str]:
    """Why runs with fingerprints a and b cannot be compared bitwise; empty when they can."""
    reasons = []
    portable = a.bi_cpu and b.bi_cpu
    fields_a, fields_b = a.compared_fields(portable=portable), b.compared_fields(portable=portable)
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
        env={name: os.environ.get(name) for name in NUMERICS_ENV_VARS + (NCCL_ENV_VARS if cuda else ())},
        arch=platform.machine(),
        bi_kernels=(_bi_kernels_cuda() if cuda else _bi_kernels()) if batch_invariant.is_enabled() else None,
        info={
            "python": platform.python_version(),
            "numpy": np.__version__,
            "titan_audit": titan_audit.__version__,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "env": {name: os.environ.get(name) for name in INFO_ENV_VARS},
            "cpu_kernel_isa": _kernel_isa(),
        },
    )


def _gemm_suffix() -> str:
    """ "" under gemm order v1 (the strings of fingerprints recorded before v2 existed), " gemm-v2"
    under v2 (batch_invariant/order.py): the order changes every gemm's bits."""
    from titan_audit.batch_invariant.order import current_gemm_order

    order = current_gemm_order()
    return "" if order == "v1" else f" gemm-{order}"


def _bi_kernels() -> str:
    """The CPU kernel library's identity: its bits-version (bumped whenever an output changes) and
    the gemm order: "titan-bi-cpu v2" (order v1), "titan-bi-cpu v2 gemm-v2" (order v2)."""
    from titan_audit.batch_invariant.cpu import kernel_library

    kernel_library.library()  # a missing or stale build is an error here too
    return f"titan-bi-cpu v{kernel_library.KERNELS_VERSION}{_gemm_suffix()}"


def _bi_kernels_cuda() -> str:
    """The CUDA kernels' identity: the Triton backend, the Triton release compiling it, the gemm order."""
    import triton

    return f"titan-bi-triton (triton {triton.__version__}){_gemm_suffix()}"


def _kernel_isa() -> str | None:
    """The kernel variant in use (informational: every variant gives the same bits)."""
    from titan_audit.batch_invariant.cpu import kernel_library

    try:
        return kernel_library.isa()
    except (kernel_library.KernelLibraryError, ValueError):
        return None


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
