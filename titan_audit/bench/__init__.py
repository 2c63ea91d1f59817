"""bench/: speed suites, each a ratio against the plain PyTorch path measured in the same run.

A suite is a function `(BenchOptions) -> list[Case]` registered in `SUITES`; `run_suite` times it
and returns the JSON object DESIGN.md section 6 specifies. Ratios are candidate time over
baseline time for the same work (lower is better), so noisy machines still give useful numbers.
"""

from titan_audit.bench.core import BenchOptions, Case, SuiteResult, check_targets, compare
from titan_audit.bench.registry import SUITES, run_suite

__all__ = ["SUITES", "BenchOptions", "Case", "SuiteResult", "check_targets", "compare", "run_suite"]
