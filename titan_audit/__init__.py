"""titan-audit: bitwise-reproducible training and RL post-training for PyTorch.

The package is layered; each subpackage imports only from the layers below it:

    cli/                    thin click commands
    bench/                  speed suites (ratios against plain PyTorch in the same run)
    trainer/  rl/           end-to-end loops
    golden/  audit/  data/  models/
    batch_invariant/  deterministic/

See DESIGN.md (shared with the project) for the five guarantees G1-G5.

Importing the package sets this process's memory policy for CPU tensors (huge pages; glibc's
malloc keeps freed memory for reuse): see `memory_policy.py`. It changes no bit.
"""

from importlib.metadata import PackageNotFoundError, version

from titan_audit import memory_policy

memory_policy.configure()

try:
    __version__ = version("titan-audit")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
