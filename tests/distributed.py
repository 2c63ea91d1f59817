"""Multi-rank test helper: `run_ranks(fn, world_size, args)` runs fn on W gloo processes.

A thin alias of `titan_audit.trainer.local_ranks.run_local_ranks` (see there)."""

from titan_audit.trainer.local_ranks import run_local_ranks as run_ranks

__all__ = ["run_ranks"]
