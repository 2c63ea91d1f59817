"""How this process gets memory for CPU tensors: set once, when `titan_audit` is imported.

Guarantee: nothing here changes a bit of any result (page size, alignment and which free block an
allocation reuses are not arithmetic); it only decides how often a fresh tensor's first touch
takes page faults. A user's own setting always wins. Two settings (issue 26):

1. `THP_MEM_ALLOC_ENABLE=1` in the environment unless it is set already: PyTorch's CPU allocator
   then backs every allocation of 2 MB or more with transparent huge pages (2 MB-aligned,
   madvise(MADV_HUGEPAGE)). Without it a fresh tensor costs one page fault per 4 KB on first
   touch; at qwen3-0.6b widths (a 620 MB head gradient per microbatch) the faults were a fifth
   of an RL step. torch reads the variable once, at its first allocation, so it works when this
   package is imported before torch (the CLI, the pytest plugin, the ranks our launchers start,
   which inherit it) and is a no-op otherwise; export it yourself to get it there, or set it to
   0 to keep 4 KB pages.

2. glibc's malloc keeps freed memory for reuse (Linux with glibc only): `mallopt` fixes the
   mmap threshold at 32 MB (glibc's largest) and the trim threshold at 1 GB. glibc's defaults
   adapt both to the sizes it has seen freed, and a training step frees its gradients and
   activations at the end of every step: the top of the heap was then handed back to the kernel,
   and the next step faulted the same pages in again. With huge pages on, torch asks for 2 MB
   alignment on every allocation of 2 MB or more, which glibc served from a fresh mmap each
   time: a 2-16 MB tensor cost ~1.5 ms of faults per allocation instead of ~60 us, and a
   tiny-dense BI step ~25% more time. With the fixed thresholds, blocks under 32 MB come from
   the heap and are reused; larger ones are mmapped (and huge pages make them cheap). The cost:
   up to 1 GB of freed heap stays with the process instead of going back to the kernel.
   Skipped when the user tunes malloc already (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`
   or `GLIBC_TUNABLES` set) or sets `TITAN_AUDIT_MALLOC=default`.
"""

from __future__ import annotations

import ctypes
import os
import sys

THP_ENV = "THP_MEM_ALLOC_ENABLE"
MALLOC_ENV = "TITAN_AUDIT_MALLOC"  # "default": leave glibc's malloc as it is
USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30

applied_mallopt = False  # whether configure() set the two malloc thresholds in this process


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
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    applied_mallopt = mmap_ok and trim_ok
