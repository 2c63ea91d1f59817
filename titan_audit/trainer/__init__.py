"""trainer/: the distributed trainer with world-size-invariant trajectories (not built yet: see issue 7)."""
