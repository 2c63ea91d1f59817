"""The bench suites by name. A suite: `(options, progress) -> list[Case]`."""

from __future__ import annotations

from collections.abc import Callable

from titan_audit.bench.audit_suite import audit_suite
from titan_audit.bench.core import BenchOptions, Case
from titan_audit.bench.data_suite import data_suite
from titan_audit.bench.generate_suite import generate_suite
from titan_audit.bench.hash_suite import hash_suite
from titan_audit.bench.ops_suite import ops_suite
from titan_audit.bench.reduce_suite import reduce_suite
from titan_audit.bench.train_suite import train_suite

Suite = Callable[[BenchOptions, Callable[[str], None]], list[Case]]

SUITES: dict[str, Suite] = {
    "audit": audit_suite,
    "data": data_suite,
    "generate": generate_suite,
    "hash": hash_suite,
    "ops": ops_suite,
    "reduce": reduce_suite,
    "train": train_suite,
}
