"""The compiled kernel library (`_titan_bi.so`, compiled from `cpu/kernels/*.cpp` by
`kernel_build.py`: `make kernels` in a checkout, the package build in `pip install .` or a wheel)
and the choice of its ISA variant.

Guarantees:
- Loading never falls back to anything: a missing library, one whose version disagrees with this
  package, or -- where the kernel sources are present (a checkout, an editable install) -- one
  built from other sources or flags than those (edited kernels, not rebuilt: the library carries
  `kernel_build.source_hash()` of what it was built from) raises `KernelLibraryError` saying what
  to run. An installed wheel ships the library without its sources and checks the version only.
  A batch-variant op never stands in for a kernel.
- Every kernel exists in the variants `scalar` (portable C++, std::fma), `avx2` (AVX2 + FMA) and
  `avx512`; all give identical bits (tests force each one the CPU has). The variant in use is
  `TITAN_AUDIT_CPU_ISA` (`auto`, `scalar`, `avx2`, `avx512`; read at import) or what `set_isa`
  / `forced_isa` chose; `auto` takes the widest the CPU supports. Asking for a variant the CPU
  cannot run is a `ValueError`.

Kernels are called through `kernel(name)`: a ctypes function `ta_<name>__<isa>` of the current
variant, with the argument types declared once by `declare(name, restype, argtypes)`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from titan_audit.batch_invariant.cpu import kernel_build

LIB_PATH = Path(__file__).with_name(kernel_build.LIB_NAME)
SOURCE_DIR = Path(__file__).with_name("kernels")
ISAS = ("scalar", "avx2", "avx512")
ENV_VAR = "TITAN_AUDIT_CPU_ISA"
KERNELS_VERSION = 2  # must equal TA_KERNELS_VERSION in kernels/ta_common.h

_LOCK = threading.Lock()
_lib: ctypes.CDLL | None = None
_isa: str | None = None
_signatures: dict[str, tuple[object, list[object]]] = {}
_functions: dict[tuple[str, str], ctypes._CFuncPtr] = {}


class KernelLibraryError(RuntimeError):
    """The compiled kernels are missing, stale or from another version of this package."""


def _build_hint() -> str:
    if kernel_build.inputs(SOURCE_DIR):
        return f"build it with `make kernels` in the titan-audit checkout (it compiles {SOURCE_DIR})"
    return "reinstall titan-audit (`pip install` compiles the kernels; it needs g++)"


def _check_built_from_sources(lib: ctypes.CDLL) -> None:
    """Where the sources are here: the library must carry their hash (see the module doc)."""
    sources = kernel_build.inputs(SOURCE_DIR)
    if not sources:
        return
    try:
        built_from = getattr(lib, kernel_build.HASH_SYMBOL)
    except AttributeError:
        raise KernelLibraryError(
            f"batch_invariant: {LIB_PATH} does not say what it was built from (an older build); {_build_hint()}"
        ) from None
    built_from.restype, built_from.argtypes = ctypes.c_char_p, []
    if built_from().decode() != kernel_build.source_hash(SOURCE_DIR):
        built = LIB_PATH.stat().st_mtime
        newer = sorted(p.name for p in sources if p.stat().st_mtime > built)
        what = (
            f"is older than its sources ({', '.join(newer)})"
            if newer
            else f"was built from other kernel sources or flags than those in {SOURCE_DIR}"
        )
        raise KernelLibraryError(f"batch_invariant: {LIB_PATH} {what}; {_build_hint()}")


def library() -> ctypes.CDLL:
    """The loaded library (loaded and checked on first use)."""
    global _lib
    if _lib is not None:
        return _lib
    with _LOCK:
        if _lib is None:
            if not LIB_PATH.exists():
                raise KernelLibraryError(
                    f"batch_invariant: the CPU kernel library {LIB_PATH} is missing; {_build_hint()}"
                )
            try:
                lib = ctypes.CDLL(str(LIB_PATH))
            except OSError as exc:
                raise KernelLibraryError(f"batch_invariant: cannot load {LIB_PATH}: {exc}; {_build_hint()}") from None
            version = lib.ta_kernels_version__scalar()
            if version != KERNELS_VERSION:
                raise KernelLibraryError(
                    f"batch_invariant: {LIB_PATH} has kernels version {version}, this package expects "
                    f"{KERNELS_VERSION}; {_build_hint()}"
                )
            _check_built_from_sources(lib)
            _lib = lib
    return _lib


def available_isas() -> tuple[str, ...]:
    """The variants this CPU can run, narrowest first."""
    lib = library()
    found = ["scalar"]
    if hasattr(lib, "ta_cpu_supports_avx2") and lib.ta_cpu_supports_avx2():
        found.append("avx2")
    if hasattr(lib, "ta_cpu_supports_avx512") and lib.ta_cpu_supports_avx512():
        found.append("avx512")
    return tuple(found)


def _resolve(name: str) -> str:
    name = name.strip().lower()
    if name == "auto":
        return available_isas()[-1]
    if name not in ISAS:
        raise ValueError(f"{ENV_VAR}: unknown ISA variant {name!r}; choose from auto, {', '.join(ISAS)}")
    if name not in available_isas():
        raise ValueError(f"{ENV_VAR}: this CPU cannot run the {name!r} variant (it has {', '.join(available_isas())})")
    return name


def isa() -> str:
    """The ISA variant in use."""
    global _isa
    if _isa is None:
        _isa = _resolve(os.environ.get(ENV_VAR, "auto"))
    return _isa


def set_isa(name: str) -> str:
    """Use variant `name` (`auto` or one of ISAS) from now on; returns the variant now in use."""
    global _isa
    _isa = _resolve(name)
    return _isa


@contextlib.contextmanager
def forced_isa(name: str) -> Iterator[str]:
    """Run a block on one variant, then restore the previous one."""
    previous = isa()
    try:
        yield set_isa(name)
    finally:
        set_isa(previous)


def declare(name: str, restype: object, argtypes: list[object]) -> None:
    """Declare the C signature of kernel `ta_<name>__<isa>` (the same for every variant)."""
    _signatures[name] = (restype, argtypes)


def kernel(name: str) -> ctypes._CFuncPtr:
    """The ctypes function for kernel `name` in the current variant."""
    key = (name, _isa or isa())
    fn = _functions.get(key)
    if fn is None:
        symbol = f"ta_{name}__{key[1]}"
        try:
            fn = getattr(library(), symbol)
        except AttributeError:
            raise KernelLibraryError(f"batch_invariant: {LIB_PATH} has no kernel {symbol}; {_build_hint()}") from None
        if name in _signatures:
            fn.restype, fn.argtypes = _signatures[name]
        _functions[key] = fn
    return fn


def ptr(t: torch.Tensor) -> int:
    """The data pointer of a tensor, for a kernel argument declared `ctypes.c_void_p`."""
    return t.data_ptr()


UNFILLED_MIN_BYTES = 128 << 10  # below this torch.empty's fill costs less than the storage route


def output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous CPU tensor for a kernel that writes every element of it: `torch.empty`
    without deterministic mode's NaN fill. Under `torch.use_deterministic_algorithms(True)` (with
    `torch.utils.deterministic.fill_uninitialized_memory`, the default) every `torch.empty` first
    writes NaN into all of its memory so that a read before a write is repeatable; a kernel output
    is written in full before anyone reads it, so that pass is wasted work (thousands of fills a
    step, a noticeable share of a small BI step). The storage is allocated directly
    (no aten factory fills it) and viewed with `set_`; no bit of any result changes. Small outputs
    take `torch.empty`, whose fill is then cheaper than the extra calls; so does every output
    while a TorchDispatchMode watches the aten ops (the op log of `bisect --step`, audit/oplog.py,
    hashes each op's outputs when the op returns: `set_`'s would be whatever the memory held)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (
        nbytes < UNFILLED_MIN_BYTES
        or not torch.are_deterministic_algorithms_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
    ):
        return torch.empty(shape, dtype=dtype)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage(nbytes), 0, shape)


def num_threads() -> int:
    """The intra-op thread count the kernels split outputs over (torch's; never changes bits)."""
    return torch.get_num_threads()
