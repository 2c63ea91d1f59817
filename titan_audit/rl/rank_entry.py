"""What torchrun runs on each RL rank: `python -m titan_audit.rl.rank_entry CONFIG_JSON OUT FLAGS...`.

Guarantee: no module imports this one, so when `python -m` imports its package first (runpy does)
this module is not in sys.modules yet, and runpy's "found in sys.modules after import of package
... unpredictable behaviour" RuntimeWarning never fires on a rank. The work is
`titan_audit.rl.launch.main` (tests/trainer/test_rank_entry.py checks both).
"""

if __name__ == "__main__":
    from titan_audit.rl.launch import main

    main()
