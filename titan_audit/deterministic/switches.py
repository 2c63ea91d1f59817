"""Global determinism switches: one call that makes PyTorch's numerics repeatable in this process.

Guarantee (G1, run-to-run): after `enable(seed)`, the same program on the same inputs, with the
same numerics fingerprint (`titan_audit.deterministic.fingerprint()`), produces the same bits.
What `enable` sets, and why:

- `torch.use_deterministic_algorithms(True)`: ops with a nondeterministic kernel (atomics,
  `index_add_` on CUDA, ...) take a deterministic one or raise (`strict=True`) / warn.
- cuDNN `deterministic=True`, `benchmark=False`: no autotuner picking kernels by timing.
- TF32 and reduced-precision fp32 matmul off everywhere (CUDA, cuDNN, oneDNN): "highest".
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: cuBLAS needs a fixed workspace to be deterministic
  (effective only if set before CUDA initialises; `enable` warns when it is too late).
- a fixed intra-op thread count (`threads`, default 1): CPU kernels may split a reduction by
  thread count, so the count is part of the numerics and must be chosen, never inherited from
  the launcher (torchrun sets OMP_NUM_THREADS by world size).
- python, numpy and torch (all devices) global RNGs seeded from `seed`.
- when CUDA is in use (`torch.cuda.is_available()`), NCCL's reduction order pinned (`NCCL_ENV`):
  ring algorithm, Simple protocol, a fixed channel count, no NVLS / CollNet (in-switch
  reductions). The trainer's gradient reduction does not rely on these (our TreeReducer sums in
  a fixed tree and only moves exact partial sums across ranks); they pin every other NCCL
  reduction (tensor-parallel all-reduces of a generator, metrics). Effective only if set before
  NCCL initialises; on a CPU-only machine they are left alone.

`enable` applies immediately and returns a handle; used as a context manager the handle restores
every switch and every RNG state on exit, exceptions included.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import TracebackType

import torch

from titan_audit.deterministic.rng import RngState, restore, seed_all, state

CUBLAS_WORKSPACE = ":4096:8"
DEFAULT_THREADS = 1
NCCL_ENV = {
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "NCCL_MIN_NCHANNELS": "8",
    "NCCL_MAX_NCHANNELS": "8",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
}


def _read_nccl_env() -> tuple[tuple[str, str | None], ...]:
    return tuple((name, os.environ.get(name)) for name in NCCL_ENV)


@dataclass(frozen=True)
class Switches:
    """Every global numerics switch `enable` touches, as read from torch."""

    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    fp32_precision: str
    float32_matmul_precision: str
    cublas_workspace_config: str | None
    num_threads: int
    nccl_env: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def read(cls) -> Switches:
        return cls(
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
            fp32_precision=_read_fp32_precision(),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            num_threads=torch.get_num_threads(),
            nccl_env=_read_nccl_env(),
        )

    def apply(self) -> None:
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        _write_fp32_precision(self.fp32_precision)
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        if self.cublas_workspace_config is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config
        torch.set_num_threads(self.num_threads)
        for name, value in self.nccl_env:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _read_fp32_precision() -> str:
    # torch >= 2.9 has one precision knob per backend; older releases only allow_tf32 flags.
    if hasattr(torch.backends, "fp32_precision"):
        return torch.backends.fp32_precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _write_fp32_precision(value: str) -> None:
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = value
    else:
        torch.backends.cuda.matmul.allow_tf32 = value == "tf32"
        torch.backends.cudnn.allow_tf32 = value == "tf32"


def deterministic_switches(strict: bool, threads: int, cuda: bool | None = None) -> Switches:
    """The switch values deterministic mode uses (`cuda`: pin NCCL; None: whether CUDA is available)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return Switches(
        deterministic_algorithms=True,
        deterministic_warn_only=not strict,
        cudnn_deterministic=True,
        cudnn_benchmark=False,
        fp32_precision="ieee",
        float32_matmul_precision="highest",
        cublas_workspace_config=CUBLAS_WORKSPACE,
        num_threads=threads,
        nccl_env=tuple(NCCL_ENV.items()) if (torch.cuda.is_available() if cuda is None else cuda) else _read_nccl_env(),
    )


class DeterministicMode:
    """Handle returned by `enable`; a context manager that undoes it on exit."""

    def __init__(self, seed: int, strict: bool, threads: int) -> None:
        self.seed = seed
        self.strict = strict
        self.threads = threads
        self._saved_switches = Switches.read()
        self._saved_rng: RngState = state()
        if torch.cuda.is_initialized() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != CUBLAS_WORKSPACE:
            warnings.warn(
                "CUDA was initialised before titan_audit.deterministic.enable(): "
                f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} may not take effect; "
                "call enable() (or export the variable) before touching CUDA",
                stacklevel=3,
            )
        deterministic_switches(strict, threads).apply()
        seed_all(seed)

    def __enter__(self) -> DeterministicMode:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._saved_switches.apply()
        restore(self._saved_rng)


def enable(seed: int, *, strict: bool = True, threads: int = DEFAULT_THREADS) -> DeterministicMode:
    """Switch this process to deterministic numerics and seed every global RNG with `seed`.

    strict: raise on ops that have no deterministic kernel (False: warn instead).
    threads: intra-op thread count; part of the numerics fingerprint.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return DeterministicMode(seed, strict, threads)


def is_enabled() -> bool:
    """True when the switches currently match deterministic mode (any thread count)."""
    now = Switches.read()
    return now == deterministic_switches(not now.deterministic_warn_only, now.num_threads)
