"""trainer/: the distributed trainer whose trajectory is bitwise the same at every world size.

config (TrainConfig, recipes), train (the loop), reduce (deterministic tree reduction), fsdp
(FSDP2 with that reduction), optim (AdamW + schedule), checkpoint (atomic, verified, reshardable),
run_dir (run directory rules, manifest, metrics), metrics_out (metrics.jsonl, TensorBoard),
launch (torchrun; rank_entry: what torchrun runs on a rank), replay (elastic replay),
typed_config (TOML/dict -> dataclasses), local_ranks (W gloo processes), crash (test kill hook).
"""
