"""audit/: tensor fingerprints and bitwise comparison; per-step audit records follow (issue 5)."""

from titan_audit.audit.bitwise import assert_bitwise_equal, bits, bitwise_equal, describe_difference
from titan_audit.audit.fingerprint import HEADER_PREFIX, fingerprint, fingerprint_many

__all__ = [
    "HEADER_PREFIX",
    "assert_bitwise_equal",
    "bits",
    "bitwise_equal",
    "describe_difference",
    "fingerprint",
    "fingerprint_many",
]
