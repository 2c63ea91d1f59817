"""golden/: golden runs kept small enough to commit, and checks of new runs against them.

`record_golden(RUN, GOLDEN)` keeps a verified subset of a run (store.py documents the format);
`check_golden(RUN, GOLDEN)` compares bitwise when the numerics fingerprints are compatible and in
an explicit, reported tolerance mode otherwise; `update_golden` replaces a golden deliberately and
says what changed (record.py); selection.py is what both compare (steps, phases, metric bits,
fingerprints). The pytest plugin (`titan_audit.golden.pytest_plugin`, entry point `pytest11`)
runs recipes and checks them against the committed `titan_audit/goldens/<name>/` in CI.
"""

from titan_audit.golden.check import GoldenCheck, check_golden
from titan_audit.golden.record import record_golden, update_golden
from titan_audit.golden.selection import parse_steps
from titan_audit.golden.store import (
    DEFAULT_PHASES,
    DEFAULT_TOLERANCES,
    FORMAT_VERSION,
    Golden,
    GoldenCorrupt,
    Tolerance,
    read_golden,
)

__all__ = [
    "DEFAULT_PHASES",
    "DEFAULT_TOLERANCES",
    "FORMAT_VERSION",
    "Golden",
    "GoldenCheck",
    "GoldenCorrupt",
    "Tolerance",
    "check_golden",
    "parse_steps",
    "read_golden",
    "record_golden",
    "update_golden",
]
