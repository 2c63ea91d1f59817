"""How the Triton kernels are compiled or interpreted, chosen per launch by the tensors' device.

`jit(fn)` makes a `DualKernel`: a `triton.JITFunction` (so compiled kernels may call it as a
helper and Triton's cache keys see it) that launches on CUDA tensors through Triton's compiler
and on CPU tensors through Triton's interpreter (`triton.runtime.interpreter`, the same one
`TRITON_INTERPRET=1` selects). So the interpreter is reached without setting `TRITON_INTERPRET`:
nothing here writes the environment, and a process can run the compiled kernels and the
interpreted ones side by side (tests force the interpreted path on CPU tensors with
`batch_invariant.backend.forced("triton")`). Triton itself is imported only when this module is,
which happens only for a CUDA tensor or a forced Triton backend (never on the CPU path).

`interpreted(t)`: whether launches on `t` run in the interpreter. The interpreter keeps bfloat16
as raw uint16 and its `tl.dot` would multiply those integers, so kernels upcast bfloat16 / float16
tiles to float32 before `tl.dot` there (`DOT_F32`); their products are exact in float32 either
way, so only the (fixed) accumulation order differs from the tensor cores' path.

In the interpreter `tl.dot` is `_fixed_order_dot`: each output element's tile sum is one chain of
adds over k in ascending order, added to the accumulator once, the same operations wherever the
element sits in its tile, as the GPU's MMA is assumed to do. Triton's own interpreter calls `np.matmul`, i.e. BLAS,
which picks its micro-kernel by the element's place in the tile (numpy's OpenBLAS on an AVX2 AMD
EPYC gives a row alone and the same row inside a tile other bits): invariance proven under it
would be a property of that CPU's BLAS, not of our kernels.

Compiled launches pass `enable_fp_fusion=False`: no multiply-add is contracted into an fma behind
our back, so the arithmetic is the one written in the kernels whatever Triton's default (it
changes in Triton 3.10), and the Triton release is recorded in the numerics fingerprint.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import triton
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


class DualKernel(JITFunction):
    """A JITFunction whose launches on CPU tensors run in Triton's interpreter."""

    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        self._interpreted: InterpretedFunction | None = None

    def _interp(self) -> InterpretedFunction:
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        assert tensors, "a kernel launch without tensor arguments"
        devices = {t.device.type for t in tensors}
        assert len(devices) == 1, f"kernel {self.fn.__name__}: tensors on {sorted(devices)}"
        if devices == {"cpu"}:
            with _interpreting():
                return self._interp().run(*args, grid=grid, warmup=warmup, **kwargs)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Reached only from an interpreted kernel calling this one as a helper (compiled kernels
        # inline helpers at compile time and never call them from Python).
        return self._interp()(*args, **kwargs)


_INTERPRETED: dict[Any, InterpretedFunction] = {}
_LOCK = threading.RLock()


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    found = _INTERPRETED.get(self.fn)
    if found is None:
        found = _INTERPRETED[self.fn] = InterpretedFunction(self.fn)
    return found(*args, **kwargs)


class _DeferredScope:
    """What the interpreter gets back from a patch: its own restore() is left to `_interpreting`."""

    def restore(self) -> None:
        pass


def _fixed_order_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """The interpreter's tl.dot (module doc): d + (the tile's products summed over k = 0, 1, ... in
    ascending order from 0), in the accumulator's dtype (float32 products of float32 tiles, exact for
    upcast bf16/fp16). Like Triton's `np.matmul(a, b) + d`, the tile's sum is added to d once, so
    the K tile size still shapes the bits (as it does on the GPU)."""
    import numpy as np

    dtype = d.data.dtype
    a_data, b_data = a.data.astype(dtype), b.data.astype(dtype)
    partial = np.zeros(np.broadcast_shapes(a_data.shape[:-1] + (1,), b_data.shape[:-2] + (1, b_data.shape[-1])), dtype)
    for k in range(a_data.shape[-1]):
        partial = partial + a_data[..., :, k : k + 1] * b_data[..., k : k + 1, :]
    return _interpreter.TensorHandle(partial + d.data, d.dtype.scalar)


@contextlib.contextmanager
def _interpreting() -> Iterator[None]:
    """While an interpreted kernel runs, a call of any JITFunction (Triton's own library helpers
    such as `tl.zeros` are JITFunctions when TRITON_INTERPRET is unset) runs interpreted too:
    what TRITON_INTERPRET=1 arranges at import time, done for the launch only."""
    with _LOCK:
        saved = JITFunction.__call__
        saved_patch = _interpreter._patch_lang
        scopes: list[Any] = []

        def patch_lang(fn: Any) -> Any:
            # The interpreter patches triton.language for the launch and again for each
            # device-function call, and never undoes the latter (under TRITON_INTERPRET=1 nothing
            # is compiled, so it does not matter there). Compiled kernels share this process, so
            # every patch is undone here, last first, when the launch is over.
            scopes.append(saved_patch(fn))
            return _DeferredScope()

        saved_dot = _interpreter.InterpreterBuilder.create_dot
        JITFunction.__call__ = _call_interpreted  # type: ignore[method-assign]
        _interpreter._patch_lang = patch_lang
        _interpreter.InterpreterBuilder.create_dot = _fixed_order_dot  # type: ignore[method-assign]
        try:
            yield
        finally:
            JITFunction.__call__ = saved  # type: ignore[method-assign]
            _interpreter._patch_lang = saved_patch
            _interpreter.InterpreterBuilder.create_dot = saved_dot  # type: ignore[method-assign]
            while scopes:
                scopes.pop().restore()


def jit(fn: Any) -> DualKernel:
    return DualKernel(fn)


def interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


@functools.cache
def num_programs(device_index: int) -> int:
    """Programs of a persistent kernel: the GPU's multiprocessor count (any fixed number would do:
    which program computes a tile never changes the tile's bits)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(t: torch.Tensor, tiles: int) -> int:
    if interpreted(t):
        return max(1, min(tiles, 4))  # the interpreter runs programs one after another
    return max(1, min(tiles, num_programs(t.device.index or 0)))


def check_device(*tensors: torch.Tensor | None) -> None:
    """Every tensor on CUDA, or every tensor on CPU (the interpreter's path)."""
    types = {t.device.type for t in tensors if t is not None}
    if not types <= {"cuda"} and types != {"cpu"}:
        raise ValueError(
            "batch_invariant (triton): tensors must be on CUDA (or all on CPU for the interpreter), "
            f"got {sorted(types)}"
        )


TRITON_VERSION = triton.__version__


def row_block(n: int, t: torch.Tensor) -> tuple[int, int]:
    """(BLOCK, warps) of a row kernel over rows of length n: a function of n alone (never of the
    row count), so every row of a given length runs the same compiled kernel."""
    cap = 256 if interpreted(t) else 4096
    block = min(cap, triton.next_power_of_2(max(n, 1)))
    return block, (1 if interpreted(t) else max(1, min(16, block // 256)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch_options(t: torch.Tensor, warps: int) -> dict[str, int]:
    return {} if interpreted(t) else {"num_warps": warps, "enable_fp_fusion": False}
