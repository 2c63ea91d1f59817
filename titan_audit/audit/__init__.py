"""audit/: tensor fingerprints, bitwise comparison, per-step audit records (Recorder, Parquet log,
zarr dumps), run comparison (first divergence) and op-level DebugMode logs."""

from titan_audit.audit.bitwise import assert_bitwise_equal, bits, bitwise_equal, describe_difference
from titan_audit.audit.compare import CompareResult, compare_runs
from titan_audit.audit.dumps import DumpWriter, list_dumps, read_dump
from titan_audit.audit.fingerprint import HEADER_PREFIX, fingerprint, fingerprint_many
from titan_audit.audit.log import AuditLogWriter, audit_dataset, read_audit_log
from titan_audit.audit.oplog import OpLogComparison, compare_op_logs, find_op_log, op_log, read_op_log, record_op_log
from titan_audit.audit.recorder import LEVELS, Recorder
from titan_audit.audit.schema import KEY, PHASES, SCHEMA
from titan_audit.audit.tensor_diff import TensorDiff, tensor_diff

__all__ = [
    "KEY",
    "LEVELS",
    "PHASES",
    "SCHEMA",
    "AuditLogWriter",
    "CompareResult",
    "DumpWriter",
    "OpLogComparison",
    "Recorder",
    "TensorDiff",
    "audit_dataset",
    "compare_op_logs",
    "compare_runs",
    "find_op_log",
    "op_log",
    "list_dumps",
    "read_audit_log",
    "read_dump",
    "read_op_log",
    "record_op_log",
    "tensor_diff",
    "HEADER_PREFIX",
    "assert_bitwise_equal",
    "bits",
    "bitwise_equal",
    "describe_difference",
    "fingerprint",
    "fingerprint_many",
]
