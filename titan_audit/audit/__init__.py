"""audit/: tensor fingerprints now; per-step audit records and run comparison follow (issue 5)."""

from titan_audit.audit.fingerprint import HEADER_PREFIX, fingerprint, fingerprint_many

__all__ = ["HEADER_PREFIX", "fingerprint", "fingerprint_many"]
