"""Live tensor bytes: the high-water mark of the bytes of every tensor storage alive at once.

    with LiveBytes() as tracker:
        train(...)
    tracker.peak["cpu"], tracker.peak[MAPPED]   # bytes; tracker.report() as a JSON-ready dict

Guarantee: measuring changes no bit of what runs. The tracker is a `TorchDispatchMode` that calls
every op exactly as it was called and only looks at the tensors that go in and come out; torch
runs the same kernels on the same inputs. (One path of ours reacts to a watching mode:
`batch_invariant/cpu/_lib.output` then takes `torch.empty` instead of an unfilled storage for a
kernel output; the kernel writes every element either way. tests/test_live_bytes.py compares a
tracked training run with an untracked one bit for bit.)

What counts: a storage (`Tensor.untyped_storage()`) is counted once, for its `nbytes()`, from the
first op that takes or returns a tensor on it (views share their base's storage and add nothing)
until the storage dies (a weakref callback on its Python object, which torch keeps for as long as
the storage lives). A storage that changes size (FSDP2 frees and re-allocates the all-gathered
parameters with `UntypedStorage.resize_`, which no op sees; `resize_`/`set_` ops) is counted at
its new size: `resize_` is wrapped while a tracker is on. The counts are kept per pool: the
device type ("cpu", "cuda", ...; meta tensors count nothing) and `MAPPED` for storages mapped from
a file (`torch.from_file`, e.g. the same-host exchange of trainer/shared_exchange.py, which every
rank of the host maps: count it once per host, not per rank). `peak[pool]` is the largest
`live[pool]` seen after any op: parameters, optimizer state, gradients, autograd's saved tensors,
the outputs of our kernels (they allocate with `torch.empty`), collective buffers. `peak_op` and
`peak_where` say where each peak was reached: the op, and the innermost frames of our own code.

What it cannot see: memory that is not a tensor storage (numpy arrays, Python objects, gloo's and
oneDNN's own buffers, the allocator's free lists: RSS covers those); temporaries inside one op (an
ATen kernel's scratch, freed before the op returns: live bytes are measured at op boundaries);
ops run on other threads (the mode is thread-local: a tensor made there is counted from the first
op on the tracked thread that uses it); and a storage made without an op (`torch.from_numpy`,
`UntypedStorage(n)`) until an op uses it.

`run_tracked(fn, directory)` is how a trainer rank turns it on (trainer/rank_entry.py, when
`ENV_DIR` is set): the rank's work runs under a tracker and `rank-<RANK>.json` in `directory` gets
`report()` with the process's peak RSS (`resource.getrusage`) and the memory policy it ran under
(memory_policy.py keeps freed heap and huge pages: RSS then shows the high-water mark of the heap,
not of live tensors; the bench runs its ranks with the policy off).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from titan_audit import memory_policy

ENV_DIR = "TITAN_AUDIT_LIVE_BYTES_DIR"  # set: each trainer rank writes rank-<RANK>.json there
MAPPED = "mapped"  # the pool of storages mapped from a file
REPORT_FORMAT = 1
WHERE_DEPTH = 4  # frames of our code kept for a peak
_PACKAGE = f"{os.sep}titan_audit{os.sep}"
_HERE = f"{os.sep}titan_audit{os.sep}live_bytes.py"

_active: list[LiveBytes] = []  # at most one tracker at a time: it owns the resize_ wrapper
_original_resize = torch.UntypedStorage.resize_  # torch._C.StorageBase's, which UntypedStorage inherits


class LiveBytes(TorchDispatchMode):
    """Counts live tensor storage bytes per pool and keeps their high-water marks (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.ops = 0  # ops seen
        self.peak_op: dict[str, str] = {}  # pool -> the op after which its peak was reached
        self.peak_where: dict[str, list[str]] = {}  # pool -> where in our code (innermost first)
        self._records: dict[int, list[Any]] = {}  # id(storage) -> [weakref, pool, nbytes]
        self._lock = threading.RLock()  # weakref callbacks run on whichever thread drops a storage

    # -- the mode
    def __enter__(self) -> LiveBytes:
        if _active:
            raise ValueError("a LiveBytes tracker is on already; one at a time")
        _active.append(self)
        torch.UntypedStorage.resize_ = _tracked_resize  # shadows the inherited method
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            del torch.UntypedStorage.resize_  # the inherited method again
            _active.remove(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.see((args, kwargs, out), op=str(func))
        return out

    # -- counting
    def see(self, tree: Any, op: str = "") -> None:
        """Count the storages of every tensor in `tree` (nested lists, tuples, dicts) not counted
        yet, re-size those whose size changed, and update the peaks (`op`: what to name a peak)."""
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self._see_tensor(leaf, op)

    def _see_tensor(self, tensor: torch.Tensor, op: str) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: what it holds is its inner tensors
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._see_tensor(inner, op)
            return
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
            return
        self.resized(storage, op)

    def resized(self, storage: torch.UntypedStorage, op: str = "UntypedStorage.resize_") -> None:
        """Count `storage` at its current size (new, or its size changed)."""
        nbytes = storage.nbytes()
        with self._lock:
            record = self._records.get(id(storage))
            if record is None:
                pool = MAPPED if storage.filename is not None else storage.device.type
                key = id(storage)
                record = [weakref.ref(storage, lambda _ref, key=key: self._forget(key)), pool, 0]
                self._records[key] = record
            if record[2] != nbytes:
                pool = record[1]
                self.live[pool] = self.live.get(pool, 0) + nbytes - record[2]
                record[2] = nbytes
                if self.live[pool] > self.peak.get(pool, 0):
                    self.peak[pool], self.peak_op[pool] = self.live[pool], op
                    self.peak_where[pool] = _where()

    def _forget(self, key: int) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self.live[record[1]] -= record[2]

    def report(self) -> dict[str, Any]:
        """Peaks and what is live now, bytes per pool (stable keys; JSON-ready)."""
        with self._lock:
            return {
                "format": REPORT_FORMAT,
                "peak_bytes": dict(sorted(self.peak.items())),
                "peak_op": dict(sorted(self.peak_op.items())),
                "peak_where": dict(sorted(self.peak_where.items())),
                "live_bytes": dict(sorted(self.live.items())),
                "storages_live": len(self._records),
                "ops": self.ops,
            }


def _where(depth: int = WHERE_DEPTH) -> list[str]:
    """The innermost `depth` frames of the calling stack in titan_audit's own code (this module
    left out), as "path:line function"."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < depth:
        path = frame.f_code.co_filename
        if _PACKAGE in path and not path.endswith(_HERE):
            frames.append(f"{path[path.rindex(_PACKAGE) + 1 :]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return frames


def _tracked_resize(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    """`UntypedStorage.resize_` while a tracker is on: resize, then count the new size."""
    result = _original_resize(storage, size)
    for tracker in _active:
        tracker.resized(storage)
    return result


def max_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_policy_state() -> dict[str, Any]:
    """The memory policy this process runs under (memory_policy.py): what RSS figures depend on."""
    return {
        "mallopt_keeps_freed_heap": memory_policy.applied_mallopt,
        memory_policy.THP_ENV: os.environ.get(memory_policy.THP_ENV),
    }


def run_tracked(fn: Callable[..., Any], directory: str | os.PathLike) -> Callable[..., Any]:
    """`fn` wrapped: it runs under a LiveBytes tracker, then `rank-<RANK>.json` (RANK from the
    environment, 0 without one) is written atomically into `directory`: the tracker's report,
    `max_rss_bytes`, the memory policy and `completed` (false when `fn` raised)."""
    from titan_audit.atomic import write_json_atomic

    def tracked(*args: Any, **kwargs: Any) -> Any:
        rank = int(os.environ.get("RANK", "0"))
        tracker = LiveBytes()
        completed = False
        try:
            with tracker:
                result = fn(*args, **kwargs)
            completed = True
            return result
        finally:
            report = tracker.report() | {
                "rank": rank,
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "completed": completed,
                "max_rss_bytes": max_rss_bytes(),
                "memory_policy": memory_policy_state(),
            }
            Path(directory).mkdir(parents=True, exist_ok=True)
            write_json_atomic(Path(directory) / f"rank-{rank}.json", report, overwrite=True)

    return tracked
