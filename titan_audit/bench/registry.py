"""The bench suites by name. A suite: `(options, progress) -> list[Case]`."""

from __future__ import annotations

from collections.abc import Callable

from titan_audit.bench.audit_suite import audit_suite
from titan_audit.bench.core import BenchOptions, Case, SuiteResult
from titan_audit.bench.data_suite import data_suite
from titan_audit.bench.generate_suite import generate_suite
from titan_audit.bench.hash_suite import hash_suite
from titan_audit.bench.memory_suite import memory_suite
from titan_audit.bench.mkl_path import mkl_code_path
from titan_audit.bench.ops_suite import ops_suite
from titan_audit.bench.reduce_suite import reduce_suite
from titan_audit.bench.rl_suite import rl_suite
from titan_audit.bench.train_suite import train_suite

Suite = Callable[[BenchOptions, Callable[[str], None]], list[Case]]

SUITES: dict[str, Suite] = {
    "audit": audit_suite,
    "data": data_suite,
    "generate": generate_suite,
    "hash": hash_suite,
    "memory": memory_suite,
    "ops": ops_suite,
    "reduce": reduce_suite,
    "rl": rl_suite,
    "train": train_suite,
}


def run_suite(name: str, options: BenchOptions, progress: Callable[[str], None] | None = None) -> SuiteResult:
    """Run the registered suite `name`; `progress(case_name)` is called as cases finish."""
    from titan_audit.deterministic import fingerprint

    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; available: {', '.join(sorted(SUITES))}")
    import torch

    threads = torch.get_num_threads()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    try:
        machine = fingerprint().to_dict()  # records the thread count the suite runs with
        machine["mkl_code_path"] = mkl_code_path()  # the native side's gemm path (vendor-dependent)
        cases = SUITES[name](options, progress or (lambda _case: None))
    finally:
        torch.set_num_threads(threads)
    return SuiteResult(suite=name, machine=machine, cases=cases)
