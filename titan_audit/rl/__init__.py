"""rl/: generators, GRPO-style updates and the zero-gap report (not built yet)."""
