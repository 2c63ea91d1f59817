"""batch_invariant/: batch-invariant ops and the aten override mode (built in issue 3).

Until the mode exists it is never on; `is_enabled()` is the one name lower layers read.
"""


def is_enabled() -> bool:
    """True while the batch-invariant override mode is active in this process."""
    return False
