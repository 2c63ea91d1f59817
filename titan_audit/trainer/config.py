"""TrainConfig: the typed, checked configuration of one training run, and the built-in recipes.

    config = load_config("tiny-dense", overrides=["steps=8", "parallel.threads=1"])
    config = load_config("my_run.toml")                    # a TOML file, same keys
    resolved = to_dict(config)                             # what manifest.json stores

Guarantees:
- A config either builds exactly as written or fails before any work with a ValueError naming the
  key (dotted path) and, for files, the file: unknown keys, wrong types, bad values (including a
  model override that is not a ModelConfig field or makes an inconsistent ModelConfig) are errors.
- The resolved config (recipe + file + overrides, every default filled in) is a plain dict that
  rebuilds the same TrainConfig (`from_dict(to_dict(c)) == c`); manifest.json stores it, and a
  resume compares it key by key (`resume_differences`).
- Sections: model (preset + ModelConfig overrides, activation checkpointing, the MoE
  load-balancing coefficient `router_aux_loss_coef`, `compute_dtype` float32 | bfloat16), data
  (token store or the built-in synthetic corpus; seq_len, global_batch_size, microbatch_size ->
  V), optimizer, schedule, parallel (mode dp | fsdp, tp: the tensor-parallel degree, threads per
  rank, backend, device cpu | cuda), checkpoint (interval, keep_last, fallback), audit (level, modules,
  flush_every_steps, stats: the phases with absmax / mean), determinism (enabled, strict,
  batch_invariant, bi_kernels: the gemm order), logging (jsonl, tensorboard: the metrics streams
  beside metrics.parquet, trainer/metrics_out.py); top-level `seed` (model init and the data
  order) and `steps`.
- Recipes `tiny-dense` and `tiny-moe`: V = 8 virtual microbatches of 1 x 64 tokens, a step well
  under a second on 2 CPU cores, a checkpoint every 4 steps; tiny-moe trains with the
  load-balancing loss at `model.router_aux_loss_coef = 0.01`.
- Neither `model.router_aux_loss_coef` nor `model.compute_dtype` is resume-mutable: both change
  the bits of every later step. Nor is `parallel.device` (cpu | cuda; a config written before the
  key existed reads as "cpu"): another device runs other kernels. A checkpoint loads on either
  device (`titan-audit replay --device cpu` of a cuda run: a new run whose manifest says so).
- `parallel.mode` and `parallel.tp` are resume-mutable: checkpoints are DCP state dicts from
  `get_state_dict`, so a DP checkpoint loads into FSDP2 and back, a TP=2 one into TP=1, and every
  layout gives the same bits in batch-invariant mode (tested).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from titan_audit.audit.recorder import DEFAULT_STATS_PHASES
from titan_audit.audit.schema import PHASES
from titan_audit.models import ModelConfig, get_preset
from titan_audit.trainer import typed_config
from titan_audit.trainer.optim import OptimizerConfig, ScheduleConfig

# Keys a resume may change: they change how long the run goes, how often it saves and what it
# logs, never the bits of a step already defined. (With schedule.decay_steps unset the cosine
# length follows `steps`, so extending a run changes the learning rate of the steps to come.)
# what a resume of any run (train or rl) may change: never the bits of a step
RUN_MUTABLE_KEYS = frozenset(
    {
        "steps",
        "checkpoint.interval",
        "checkpoint.keep_last",
        "checkpoint.fallback",
        "audit.flush_every_steps",
        "audit.stats",  # which records carry absmax / mean: never a hash
        "parallel.backend",
        "determinism.census",  # record or stop: never the bits of a step (a strict run that passes is the same run)
        "logging.jsonl",  # where the metrics go besides metrics.parquet: never the bits of a step
        "logging.tensorboard",
    }
)
RESUME_MUTABLE_KEYS = RUN_MUTABLE_KEYS | {"parallel.mode", "parallel.tp", "data.workers"}


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelSection:
    preset: str = "tiny-dense"
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields
    activation_checkpointing: bool = False
    # MoE load-balancing loss coefficient (HF Qwen3-MoE `router_aux_loss_coef`); 0: not in the
    # loss (still logged for an MoE model). The loss adds coef * aux_mb / V per microbatch.
    router_aux_loss_coef: float = 0.0
    # dtype of the forward/backward; parameters, gradients and AdamW state stay float32 (masters)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        model = self.model_config()  # checked now, so a bad preset or override fails before any work
        if not math.isfinite(self.router_aux_loss_coef) or self.router_aux_loss_coef < 0:
            raise ValueError(
                f"model.router_aux_loss_coef must be a finite number >= 0, got {self.router_aux_loss_coef}"
            )
        if self.router_aux_loss_coef > 0 and not model.is_moe:
            raise ValueError(
                f"model.router_aux_loss_coef = {self.router_aux_loss_coef} needs an MoE model "
                f"(model.preset {self.preset!r} has num_experts = 0)"
            )

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.compute_dtype]

    def model_config(self) -> ModelConfig:
        base = get_preset(self.preset)
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        for key in sorted(self.overrides):
            if key not in known:
                raise ValueError(f"unknown key 'model.overrides.{key}'; ModelConfig fields: {', '.join(sorted(known))}")
        try:
            return dataclasses.replace(base, **self.overrides)
        except (TypeError, ValueError) as error:
            raise ValueError(f"model.overrides: {error}") from None


@dataclass
class DataSection:
    store: str | None = None  # an existing token store; None: the built-in synthetic corpus
    synthetic_records: int = 4096  # synthetic corpus size (prepared into RUN/data/)
    synthetic_seed: int = 0
    seq_len: int = 64
    global_batch_size: int = 8  # sequences per step
    microbatch_size: int = 1  # sequences per virtual microbatch; V = global / micro
    packing: Literal["concat", "best_fit"] = "concat"
    workers: int = 0

    def __post_init__(self) -> None:
        for key in ("synthetic_records", "seq_len", "global_batch_size", "microbatch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key} must be >= 1, got {getattr(self, key)}")
        if self.global_batch_size % self.microbatch_size:
            raise ValueError(
                f"data.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"data.microbatch_size ({self.microbatch_size})"
            )
        if self.workers < 0:
            raise ValueError(f"data.workers must be >= 0, got {self.workers}")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size


DEVICES = ("cpu", "cuda")


@dataclass
class ProcessSection:
    """What every rank of a run shares: the device it computes on, its intra-op thread count and
    the process-group backend (the `parallel` section of an RL run; the train loop's adds the
    data-parallel mode).

    device: "cpu", or "cuda" (rank r of a node on GPU LOCAL_RANK; the weights are initialised on
    the CPU, then moved: trainer/run.py). It changes the bits of every step, so a resume may not
    change it; `backend = "auto"` resolves by it (nccl for cuda, gloo for cpu)."""

    threads: int = 1  # intra-op threads per rank: part of the numerics, never derived from W
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    tp: int = 1  # tensor-parallel ranks per data-parallel rank (W = dp * tp): a layout, never the bits
    device: Literal["cpu", "cuda"] = "cpu"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"parallel.device must be one of {', '.join(map(repr, DEVICES))}, got {self.device!r}")
        if self.threads < 1:
            raise ValueError(f"parallel.threads must be >= 1, got {self.threads}")
        if self.tp < 1:
            raise ValueError(f"parallel.tp must be >= 1, got {self.tp}")

    def data_parallel_size(self, world_size: int) -> int:
        """dp = W / parallel.tp (ValueError unless tp divides W)."""
        if world_size < 1 or world_size % self.tp:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.tp = {self.tp} (--nproc = dp x tp)"
            )
        return world_size // self.tp


@dataclass
class ParallelSection(ProcessSection):
    mode: Literal["dp", "fsdp"] = "dp"


@dataclass
class CheckpointSection:
    interval: int = 4  # steps between checkpoints; 0: none but the last
    keep_last: int = 3
    fallback: bool = True  # on resume, skip a corrupt newest checkpoint for an older good one (said on stderr)

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"checkpoint.interval must be >= 0, got {self.interval}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class AuditSection:
    level: Literal["off", "params", "full"] = "params"
    modules: list[str] = field(default_factory=lambda: ["*"])  # globs (level full)
    flush_every_steps: int = 50  # also flushed at every checkpoint and at the end
    # the phases whose records carry absmax and mean (informational, never compared); [] for none:
    # level full then pays only for its hashes (audit/recorder.py DEFAULT_STATS_PHASES)
    stats: list[str] = field(default_factory=lambda: list(DEFAULT_STATS_PHASES))

    def __post_init__(self) -> None:
        if self.flush_every_steps < 1:
            raise ValueError(f"audit.flush_every_steps must be >= 1, got {self.flush_every_steps}")
        for i, phase in enumerate(self.stats):
            if phase not in PHASES:
                raise ValueError(f"audit.stats[{i}]: {phase!r} is not a phase; choose from {', '.join(PHASES)}")


@dataclass
class LoggingSection:
    """The per-step metrics streams beside RUN/metrics.parquet (rank 0, append only, flushed every
    step; trainer/metrics_out.py). Never the bits of a step: resume-mutable, and no config
    difference for `compare` or golden checks (audit/config_diff.py)."""

    jsonl: bool = True  # RUN/metrics.jsonl: one JSON object per step, the metrics.parquet row
    tensorboard: bool = False  # RUN/tensorboard/: TensorBoard event files (the `tensorboard` package)


@dataclass
class DeterminismSection:
    enabled: bool = True  # False: no deterministic switches, plain all_reduce of accumulated grads
    strict: bool = True  # raise on ops without a deterministic kernel
    batch_invariant: bool = False  # run forward/backward with the batch-invariant ops
    # BI op census (batch_invariant/census.py): "record" counts native ops into the manifest
    # (bi_census), "strict" stops the run at the first one, naming it and its call site, "off"
    # installs no census (what `bench train` measures it against)
    census: Literal["record", "strict", "off"] = "record"
    # gemm summation order of BI mode (batch_invariant/order.py): "v2" the blocked halving tree
    # (TP shards reproduce it), "v1" one fma chain over K (the order of runs and goldens recorded
    # before v2: a saved config without this key reads as "v1")
    bi_kernels: Literal["v1", "v2"] = "v2"
    # order of the clip norm's sum (trainer/grad_norm.py): "v2" row by row where the gradient lives
    # (no gather under FSDP2 / TP), "v1" one sum over the whole flat gradient (the order of runs and
    # goldens recorded before v2: a saved config without this key reads as "v1")
    grad_norm: Literal["v1", "v2"] = "v2"


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 16
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    audit: AuditSection = field(default_factory=AuditSection)
    determinism: DeterminismSection = field(default_factory=DeterminismSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    @property
    def num_microbatches(self) -> int:
        return self.data.num_microbatches

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless dp = W / parallel.tp divides V (the global batch plan needs whole
        blocks per data-parallel rank)."""
        v, dp = self.num_microbatches, self.parallel.data_parallel_size(world_size)
        if v % dp:
            what = f"world size {world_size}" if dp == world_size else f"dp = {dp} (world size {world_size} / tp)"
            raise ValueError(
                f"{what} does not divide the number of virtual microbatches V = {v} "
                f"(data.global_batch_size / data.microbatch_size); "
                f"use dp in {[w for w in range(1, v + 1) if not v % w]}"
            )


_TINY = {
    "steps": 16,
    "data": {"seq_len": 64, "global_batch_size": 8, "microbatch_size": 1, "synthetic_records": 4096},
    "optimizer": {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "schedule": {"warmup_steps": 4, "min_lr_ratio": 0.1},
    "checkpoint": {"interval": 4, "keep_last": 3},
}
RECIPES: dict[str, dict[str, Any]] = {
    "tiny-dense": typed_config.merge(_TINY, {"model": {"preset": "tiny-dense"}}),
    "tiny-moe": typed_config.merge(_TINY, {"model": {"preset": "tiny-moe", "router_aux_loss_coef": 0.01}}),
}


def from_dict(data: dict[str, Any], where: str = "") -> TrainConfig:
    return typed_config.build(TrainConfig, data, where)


def to_dict(config: TrainConfig) -> dict[str, Any]:
    return typed_config.to_dict(config)


def load_config(source: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A recipe name or a TOML file (which may name a base recipe with top-level `recipe = "..."`),
    then `--set` overrides. Errors name the key and the file."""
    return typed_config.load(TrainConfig, source, RECIPES, overrides, what="recipe")


def resume_differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Keys (dotted) whose values differ between a run's saved config and `current`, other than
    the keys a resume may change (RESUME_MUTABLE_KEYS); see `typed_config.resume_differences`."""
    return typed_config.resume_differences(saved, current, RESUME_MUTABLE_KEYS)
