"""What torchrun runs on each training rank: `python -m titan_audit.trainer.rank_entry LAUNCH_JSON OUT`.

Guarantee: no module imports this one, so when `python -m` imports its package first (runpy does)
this module is not in sys.modules yet, and runpy's "found in sys.modules after import of package
... unpredictable behaviour" RuntimeWarning never fires on a rank. The work is the train job's
(`rank_main(TRAIN_JOB, ...)`, trainer/launch/rank.py; tests/trainer/test_rank_entry.py checks both).

With `TITAN_AUDIT_LIVE_BYTES_DIR=DIR` in the environment (`live_bytes.ENV_DIR`), the rank's run
goes under a live-tensor-bytes tracker and the rank writes DIR/rank-<RANK>.json when its run
ends: peak live tensor bytes, peak RSS, the memory policy (titan_audit/live_bytes.py; what
`titan-audit bench memory` reads). Measuring changes no bit of the run.
"""

if __name__ == "__main__":
    import functools
    import os
    import sys

    from titan_audit.live_bytes import ENV_DIR, run_tracked
    from titan_audit.trainer.launch.rank import rank_main
    from titan_audit.trainer.train import TRAIN_JOB

    directory = os.environ.get(ENV_DIR)
    rank_main(TRAIN_JOB, sys.argv[1:], wrap=functools.partial(run_tracked, directory=directory) if directory else None)
