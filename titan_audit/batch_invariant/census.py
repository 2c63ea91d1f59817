"""The op census of batch-invariant mode: what computes on a CPU tensor while the mode is on.

Guarantee (CPU): while BI mode is on, every aten op that reaches a CPU kernel with a floating
tensor in its arguments is one of three kinds, and nothing else runs unnoticed:
- ours: the overrides of `mode.py` (our compiled kernels);
- exact: an op whose result IEEE 754 fixes bit for bit on every CPU (`EXACT`: add, mul, div,
  compare, select, copy, cast, view, index, gather...), or an op with no floating tensor at all
  (integer and bool arithmetic is exact); a few of them are exact only for some arguments and are
  judged per call (`JUDGED`: `add` with alpha != 1 runs a fused multiply-add in ATen's vector
  code, an unstable sort may order ties by ISA, `index_put_` with accumulate adds in any order);
- native: anything else (sqrt, exp, pow, tanh, norms, other reductions, BLAS, oneDNN, torch's
  RNG). In the default mode it runs and is counted (`seen()`: op, count, reason, first call
  site), so the run's manifest and report can say "native ops seen"; under `strict()` it raises
  `NativeOpError` naming the op and its Python call site before anything is computed.

How it sees everything: a guard kernel of ours is registered at the CPU dispatch key of every
aten op that is neither ours nor on `EXACT`, and calls the op's original kernel after the check
(`torch.library.get_kernel`). Dispatcher registrations are process-wide, so the census sees
every thread (the RL rollout thread, an in-process vLLM engine), and it sits where the work is
done, so it sees nested calls too: an op called inside one of our Python overrides, or inside a
composite op, reaches the dispatcher like any other. (A `TorchDispatchMode` would miss both: it
is thread-local and turns itself off inside its own handler.) An ATen kernel that calls another
kernel's C++ function directly, without the dispatcher, stays invisible: that is ATen's inner
code of one op, counted as that op.

`TITAN_AUDIT_BI_STRICT=1` in the environment makes strict the process default (e.g. to run a
whole test suite strict). The guards are installed with the mode (`mode.enable`) and removed with
it (`mode.disable`); off, they cost nothing. On, an op of `EXACT` runs untouched (no guard at all), a judged op pays one
Python call, and a native op pays one Python call plus the count.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


class NativeOpError(RuntimeError):
    """Strict census: a native (CPU-dependent) aten op was about to run in batch-invariant mode."""


# Ops whose every call is exact on every IEEE CPU (a name covers all its overloads: the
# functional, in-place `name_` and `.out` forms). What "exact" means here: each output element is
# a correctly rounded IEEE operation of its inputs (+ - * /, casts), a selection or comparison of
# input values, a copy, or bookkeeping with no floating arithmetic at all.
EXACT = frozenset(
    """
    mul div neg abs sign sgn reciprocal copysign fmod floor ceil trunc round frac
    maximum minimum fmax fmin clamp clamp_min clamp_max where masked_fill masked_scatter masked_select
    eq ne lt le gt ge isnan isinf isfinite isposinf isneginf signbit nan_to_num logical_and logical_or
    logical_xor logical_not bitwise_and bitwise_or bitwise_xor bitwise_not
    copy_ _copy_from _copy_from_and_resize _to_copy clone contiguous fill_ zero_ empty empty_strided
    empty_like zeros zeros_like ones ones_like full full_like new_empty new_empty_strided new_zeros
    new_ones new_full resize_ resize_as_ set_ _local_scalar_dense equal is_nonzero
    view view_as_real view_as_complex _reshape_alias _unsafe_view as_strided as_strided_ alias
    expand permute transpose t squeeze unsqueeze select slice narrow unfold split split_with_sizes
    unbind chunk detach _conj _neg_view real imag diagonal _indices _values indices values
    cat _cat stack index index_select index_fill index_copy gather scatter take put flip roll tril triu
    repeat repeat_interleave tile nonzero nonzero_static argwhere searchsorted bucketize
    max min amax amin argmax argmin aminmax
    cumsum _assert_async _assert_tensor_metadata _functional_assert_async record_stream
    embedding
    lift_fresh lift _has_compatible_shallow_copy_type
    count_nonzero any all
""".split()
)
EXACT = frozenset(name[:-1] if name.endswith("_") and not name.endswith("__") else name for name in EXACT)
# cumsum: ATen's CPU kernel is one sequential scan per slice, accumulating in double for float
# (aten/src/ATen/native/cpu/ReduceOpsKernel.cpp, cpu_cum_base_kernel); the order is the index.
# max/min/argmax/...: exact selections (ties: the first index); sort is judged (stable only).


def floating(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    if isinstance(value, (list, tuple)):
        return any(floating(v) for v in value)
    return False


def _alpha_one(args: tuple, kwargs: dict) -> str | None:
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    return None if alpha == 1 else f"alpha={alpha!r} (a fused multiply-add in ATen's vector code)"


def _distinct_destinations(args: tuple, kwargs: dict) -> str | None:
    """index_put_(self, indices, values, accumulate): exact without accumulate, and with it when
    the indices name every destination at most once (one addend each, as in the backward of
    `x[idx]` with distinct idx): checked here on the integer indices."""
    accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    if not accumulate:
        return None
    reason = "accumulate=True with repeated destinations (adds in ATen's order)"
    self, indices = args[0], list(args[1])
    if not indices or any(i is None for i in indices) or len(indices) > self.dim():
        return reason
    linear = None
    for dim, index in enumerate(indices):
        if index.dtype == torch.bool:
            if len(indices) != 1:
                return reason
            return None  # a mask names each element at most once
        index = index.remainder(self.shape[dim])
        linear = index if linear is None else linear * self.shape[dim] + index
    flat = linear.reshape(-1)
    return None if torch.unique(flat).numel() == flat.numel() else reason


def _stable(args: tuple, kwargs: dict) -> str | None:
    stable = kwargs.get("stable", args[1] if len(args) > 1 and isinstance(args[1], bool) else False)
    return None if stable else "stable=False (ties in an ISA-chosen order)"


def _no_reduce(args: tuple, kwargs: dict) -> str | None:
    reduce = kwargs.get("reduce", args[4] if len(args) > 4 else None)
    return None if reduce is None else f"reduce={reduce!r} (reduces in an unspecified order)"


def _single_source(args: tuple, kwargs: dict) -> str | None:
    """scatter_add(self, dim, index, src): exact when index has length 1 along dim (every output
    element receives at most one addend, as in gather's backward)."""
    dim, index = args[1], args[2]
    if isinstance(index, torch.Tensor) and index.dim() and index.shape[dim] == 1:
        return None
    return "several addends per element (ATen's order)"


def _no_candidates(args: tuple, kwargs: dict) -> str | None:
    """topk(self, k, ...): exact (nothing selected) for k = 0, what vLLM's sampler asks when no
    top log-probs are wanted; otherwise the order of ties is ATen's choice."""
    k = kwargs.get("k", args[1] if len(args) > 1 else None)
    return None if k == 0 else f"k={k!r} (ties in an unspecified order)"


def _integral_range(args: tuple, kwargs: dict) -> str | None:
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    if all(isinstance(s, int) or (isinstance(s, float) and s.is_integer()) for s in scalars):
        return None
    return f"non-integral bounds {scalars!r} (start + i * step, rounding chosen by ATen)"


def _rounding_mode(args: tuple, kwargs: dict) -> str | None:
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    return None if mode is None else f"rounding_mode={mode!r}"


# Ops exact for some arguments only: the judge returns None (exact) or why this call is not.
JUDGED: dict[str, Callable[[tuple, dict], str | None]] = {
    "rsub": _alpha_one,
    "index_put": _distinct_destinations,
    "_index_put_impl": _distinct_destinations,
    "sort": _stable,
    "scatter": _no_reduce,
    "arange": _integral_range,
    "scatter_add": _single_source,
    "topk": _no_candidates,
}


def _no_decimals(args: tuple, kwargs: dict) -> str | None:
    decimals = kwargs.get("decimals", args[1] if len(args) > 1 else 0)
    return None if decimals == 0 else f"decimals={decimals!r} (a scaling by 10**decimals)"


# Overloads of EXACT names that are judged all the same (division with a rounding mode, rounding
# to decimals).
JUDGED_OVERLOADS: dict[str, Callable[[tuple, dict], str | None]] = {
    **{
        f"div{form}.{overload}": _rounding_mode
        for form in ("", "_")
        for overload in ("Tensor_mode", "Scalar_mode", "out_mode", "Scalar_mode_out")
    },
    **{f"round{form}.{overload}": _no_decimals for form in ("", "_") for overload in ("decimals", "decimals_out")},
}


def base_name(op: str) -> str:
    """'aten::add_.Tensor' -> 'add' (the name shared by the functional, in-place and out forms)."""
    name = op.split("::", 1)[-1].split(".", 1)[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


@dataclass
class Sighting:
    """One native op seen in BI mode: how often, why it is native, where it was first called."""

    op: str
    reason: str
    count: int
    first_site: str


_LOCK = threading.Lock()
_SEEN: dict[tuple[str, str], Sighting] = {}
_OFF: list[bool] = []
_STRICT: list[bool] = [os.environ.get("TITAN_AUDIT_BI_STRICT", "") == "1"]
_TORCH_DIR = os.path.dirname(torch.__file__)
_ROUTING_FILES = {os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "elementwise.py")}


def call_site() -> str:
    """file:line (function) of the innermost Python frame outside torch and the routing code."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) not in _ROUTING_FILES:
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<no Python frame>"


@contextlib.contextmanager
def off() -> Iterator[None]:
    """BI mode turned on inside the block installs no census (a run's `determinism.census = "off"`,
    and the census-off side of `bench train`); the routes, which define the numerics, stay."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


@contextlib.contextmanager
def strict(on: bool = True) -> Iterator[None]:
    """Strict (or, with on=False, recording) census within the block; the previous setting after."""
    _STRICT.append(bool(on))
    try:
        yield
    finally:
        _STRICT.pop()


def seen() -> list[Sighting]:
    """The native ops counted since the last `reset()`, most frequent first."""
    with _LOCK:
        rows = [Sighting(s.op, s.reason, s.count, s.first_site) for s in _SEEN.values()]
    return sorted(rows, key=lambda s: (-s.count, s.op))


def summary() -> dict[str, dict[str, Any]]:
    """`seen()` as JSON-ready data: {op: {count, reason, first_site}} (what a manifest stores)."""
    return {
        s.op if s.reason == "native" else f"{s.op} [{s.reason}]": {
            "count": s.count,
            "reason": s.reason,
            "first_site": s.first_site,
        }
        for s in seen()
    }


def reset() -> None:
    with _LOCK:
        _SEEN.clear()


def note(op: str, reason: str) -> None:
    if _STRICT[-1]:
        raise NativeOpError(
            f"batch_invariant strict census: native op {op} ({reason}) at {call_site()}: its bits may depend on "
            "the CPU; route it to a titan_audit kernel or an exact op"
        )
    key = (op, reason)
    with _LOCK:
        sighting = _SEEN.get(key)
        if sighting is None:
            _SEEN[key] = Sighting(op, reason, 1, call_site())
        else:
            sighting.count += 1


def _guard(op: str, kernel: Any, judge: Callable[[tuple, dict], str | None] | None) -> Callable[..., Any]:
    if judge is not None:

        def judged(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            reason = judge(args, kwargs)
            if reason is not None and (floating(args) or floating(tuple(kwargs.values()))):
                note(op, reason)
            return kernel(keyset, *args, **kwargs)

        return judged

    def native(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if floating(args) or floating(tuple(kwargs.values())):
            note(op, "native")
            return kernel(keyset, *args, **kwargs)
        out = kernel(keyset, *args, **kwargs)  # integer work, or a float made from scalars
        if floating(out if isinstance(out, tuple) else (out,)):
            note(op, "native")
        return out

    return native


class _Original:
    """An op's CPU kernel from before the mode registered its own, called boxed. A Python number
    that reaches one of our kernels for a Tensor parameter (the dispatcher hands wrapped numbers
    to Python as numbers) goes back as a 0-dim tensor of the dtype promotion gives it: float64
    beside a floating tensor (cast to the tensor's dtype by the op, as a wrapped number is), else
    the default dtype, so the result dtype is the one of the original call."""

    __slots__ = ("kernel", "positions", "keywords")

    def __init__(self, op: str) -> None:
        name, _, overload = op.partition(".")
        self.kernel = torch.library.get_kernel(op, "CPU")
        schema = torch._C._get_schema(name, overload)
        tensor = [a for a in schema.arguments if str(a.type) in ("Tensor", "Tensor?")]
        self.positions = tuple(i for i, a in enumerate(schema.arguments) if a in tensor and not a.kwarg_only)
        self.keywords = tuple(a.name for a in tensor if a.kwarg_only)

    def tensors_only(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        """The call when no Tensor parameter holds a Python number (nothing to convert)."""
        return self.kernel.call_boxed(keyset, *args, **kwargs)

    def __call__(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        numbers = [i for i in self.positions if i < len(args) and isinstance(args[i], (int, float, complex))]
        if numbers:
            float_dtype = torch.float64 if floating(args) else torch.get_default_dtype()
            args = tuple(_as_tensor(a, float_dtype) if i in numbers else a for i, a in enumerate(args))
        return self.kernel.call_boxed(keyset, *args, **kwargs)


def _as_tensor(value: int | float | complex, float_dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(value, dtype=float_dtype if isinstance(value, float) else None)


_ORIGINALS: dict[str, _Original] = {}  # op -> its original CPU kernel, fetched before anything of ours is registered


def original(op: str) -> _Original:
    """The CPU kernel `op` ('aten::name.overload') had before the mode registered its own
    (`prefetch` fetched it while no kernel of ours was installed); call it as (keyset, *args)."""
    return _ORIGINALS[op]


def call_native(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run `op`'s native CPU kernel, bypassing the mode's routes and guards (negative controls:
    "this is what torch's own kernel would have computed here"). Only for ops the mode has
    registered over (fetched before ours)."""
    if op not in _ORIGINALS:
        raise ValueError(f"census.call_native: {op} is not an op batch-invariant mode overrides")
    return _ORIGINALS[op](torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs)


def prefetch(ops: list[str]) -> None:
    """Remember the CPU kernels of `ops` (qualified names); call before registering over them."""
    for op in ops:
        if op not in _ORIGINALS:
            _ORIGINALS[op] = _Original(op)


def guarded_ops(ours: set[str]) -> list[str]:
    """Every aten op (qualified 'aten::name.overload') with a CPU kernel that is neither ours
    (`ours`: base names and 'name.overload' of the mode's overrides) nor always exact."""
    out = []
    for op in torch._C._dispatch_get_all_op_names():
        if not op.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"):
            continue
        short = op[len("aten::") :]
        name = base_name(op)
        if short in ours or (short.endswith(".default") and short[:-8] in ours):
            continue
        if name in EXACT and name not in JUDGED and short not in JUDGED_OVERLOADS:
            continue
        out.append(op)
    return out


_GUARDS: dict[str, Callable[..., Any]] = {}  # 'name.overload' -> its guard, made once per process


def install(library: torch.library.Library, ours: set[str]) -> int:
    """Register the guards in `library` (the mode's, destroyed by `disable`); returns how many
    (0 inside `off()`)."""
    if _OFF:
        return 0
    if not _GUARDS:
        ops = guarded_ops(ours)
        prefetch(ops)
        for op in ops:
            short = op[len("aten::") :]
            judge = JUDGED_OVERLOADS.get(short) or JUDGED.get(base_name(op))
            _GUARDS[short] = _guard(op, _ORIGINALS[op], judge)
    for short, guard in _GUARDS.items():
        library.impl(short, guard, "CPU", with_keyset=True)
    return len(_GUARDS)
