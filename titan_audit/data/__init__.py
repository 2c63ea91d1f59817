"""data/: the elastically deterministic data loader (not built yet: see issue 6)."""
