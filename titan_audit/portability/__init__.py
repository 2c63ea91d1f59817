"""Portability: the same bits on every CPU, checked rather than assumed.

The kernel golden (`tests/golden/kernels.json`) pins one xxh3-128 hash per (kernel, case) of our
compiled kernels' outputs on a battery of inputs made from integers (`battery.py`, running the
C++ harness `batch_invariant/cpu/battery/battery.cpp`, natively or arm64 under qemu-user), and per
(op, case) of the torch ops a batch-invariant step runs (`torch_ops.py`). Every ISA variant and
thread count of every CPU must reproduce each hash exactly (`kernel_golden.check`); the file lists
the CPUs it passed on, appended only by `kernel_golden.mark_passed` after a passing check.
CLI: `titan-audit golden kernels [--record [--force]] [--mark-passed] [--arch aarch64] [--json]`.
"""

from titan_audit.portability.kernel_golden import DEFAULT_PATH, check, check_report, load, mark_passed, record

__all__ = ["DEFAULT_PATH", "check", "check_report", "load", "mark_passed", "record"]
