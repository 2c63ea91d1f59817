"""What torchrun runs on each RL rank: `python -m titan_audit.rl.rank_entry LAUNCH_JSON OUT`.

Guarantee: no module imports this one, so when `python -m` imports its package first (runpy does)
this module is not in sys.modules yet, and runpy's "found in sys.modules after import of package
... unpredictable behaviour" RuntimeWarning never fires on a rank. The work is the RL job's
(`rank_main(RL_JOB, ...)`, trainer/launch/rank.py; tests/trainer/test_rank_entry.py checks both).
"""

if __name__ == "__main__":
    import sys

    from titan_audit.rl.loop import RL_JOB
    from titan_audit.trainer.launch.rank import rank_main

    rank_main(RL_JOB, sys.argv[1:])
