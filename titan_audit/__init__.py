"""titan-audit: bitwise-reproducible training and RL post-training for PyTorch.

The package is layered; each subpackage imports only from the layers below it:

    cli/                    thin click commands
    bench/                  speed suites (ratios against plain PyTorch in the same run)
    trainer/  rl/           end-to-end loops
    golden/  audit/  data/  models/
    batch_invariant/  deterministic/

See DESIGN.md (shared with the project) for the five guarantees G1-G5.

Importing the package sets `THP_MEM_ALLOC_ENABLE=1` in the environment unless it is set already:
PyTorch's CPU allocator then backs every allocation of 2 MB or more with transparent huge pages
(2 MB-aligned, madvise(MADV_HUGEPAGE)). Without it each fresh tensor costs one page fault per 4 KB
on first touch; at qwen3-0.6b widths (a 620 MB head gradient per microbatch) the faults were a
fifth of an RL step (issue 26). It changes no bit (page size and alignment are not arithmetic).
torch reads the variable once, at its first allocation, so it works when this package is
imported before torch (the CLI, the ranks our launchers start, which inherit it) and is a no-op
otherwise; export it yourself to get it there, or set it to 0 to keep 4 KB pages.
"""

import os
from importlib.metadata import PackageNotFoundError, version

THP_ENV = "THP_MEM_ALLOC_ENABLE"
os.environ.setdefault(THP_ENV, "1")

try:
    __version__ = version("titan-audit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
