"""golden/: golden runs and CI golden-run checks (not built yet: see issue 8)."""
