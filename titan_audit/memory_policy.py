"""How this process gets memory for CPU tensors: set once, when `titan_audit` is imported.

Guarantee: nothing here changes a bit of any result (page size, alignment and which free block an
allocation reuses are not arithmetic); it only decides how often a fresh tensor's first touch
takes page faults. A user's own setting always wins. Two settings:

1. `THP_MEM_ALLOC_ENABLE=1` in the environment unless it is set already: PyTorch's CPU allocator
   then backs every allocation of 2 MB or more with transparent huge pages (2 MB-aligned,
   madvise(MADV_HUGEPAGE)). Without it a fresh tensor costs one page fault per 4 KB on first
   touch; at qwen3-0.6b widths (a 620 MB head gradient per microbatch) the faults were a fifth
   of an RL step. torch reads the variable once, at its first allocation, so it works when this
   package is imported before torch (the CLI, the pytest plugin, the ranks our launchers start,
   which inherit it) and is a no-op otherwise; export it yourself to get it there, or set it to
   0 to keep 4 KB pages.

2. glibc's malloc keeps what the process frees, for reuse (Linux with glibc only): `mallopt`
   turns off malloc's own mmap (`M_MMAP_MAX=0`) and heap trimming (`M_TRIM_THRESHOLD=-1`), so
   every block comes from the heap and a freed block stays with the process. glibc's defaults
   mmap a fresh region for each large block (and, with huge pages on, for every 2 MB-aligned
   block of 2 MB or more) and hand it back to the kernel on free: a training step frees its
   gradients and activations at the end of every step, and the next step faults the same memory
   in again. On 2-core AMD EPYC VMs a 2-16 MB tensor costs ~1.5 ms of faults
   per allocation instead of ~60 us (a tiny-dense BI step ~25% more time); at qwen3-0.6b widths
   a 40-750 MB block freshly faulted costs up to 1.5 ms per MB where the hypervisor had taken the
   freed memory back (free page reporting), about half of a 5 s training step (2.6-2.8 s with
   the policy). The cost: the process keeps its peak heap until it exits (at those widths a BI
   training process peaks at 9.0 GB instead of 5.8: freed blocks are reused, not returned).
   Skipped when the user tunes malloc already (`MALLOC_MMAP_MAX_`, `MALLOC_MMAP_THRESHOLD_`,
   `MALLOC_TRIM_THRESHOLD_` or `GLIBC_TUNABLES` set) or sets `TITAN_AUDIT_MALLOC=default`.
"""

from __future__ import annotations

import ctypes
import os
import sys

THP_ENV = "THP_MEM_ALLOC_ENABLE"
MALLOC_ENV = "TITAN_AUDIT_MALLOC"  # "default": leave glibc's malloc as it is
USER_MALLOC_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc <malloc.h>
NO_MMAP = 0  # M_MMAP_MAX: no block is mmapped by malloc
NO_TRIM = -1  # M_TRIM_THRESHOLD: never trim the heap (mallopt(3))

applied_mallopt = False  # whether configure() set both malloc parameters in this process


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only: musl has mallopt too, without these knobs)
        return libc
    except (OSError, AttributeError):
        return None


def configure() -> None:
    """Apply both settings (see the module doc); called by `titan_audit/__init__.py`."""
    global applied_mallopt
    os.environ.setdefault(THP_ENV, "1")
    if applied_mallopt or os.environ.get(MALLOC_ENV, "").strip().lower() == "default":
        return
    if any(name in os.environ for name in USER_MALLOC_SETTINGS):
        return
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; a glibc that refuses a value keeps its default (speed only)
    mmap_ok = libc.mallopt(M_MMAP_MAX, NO_MMAP) == 1
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1
    applied_mallopt = mmap_ok and trim_ok
