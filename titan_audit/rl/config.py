"""RLConfig: the typed, checked configuration of one RL (GRPO-style) run, and the RL recipes.

    config = load_rl_config("rl-tiny", overrides=["steps=20", "rollout.lag=2"])
    config = load_rl_config("my_rl.toml")           # a TOML file, same keys (may name `recipe = "rl-tiny"`)

Guarantees (as trainer/config.py, whose machinery this reuses):
- A config builds exactly as written or fails before any work with a ValueError naming the key:
  unknown keys, wrong types, bad values (an unknown task, temperature <= 0, a lag larger than
  the rollout buffer, a prompt count the world size does not divide, ...).
- `from_dict(to_dict(c)) == c`; manifest.json stores the resolved config and a resume compares it
  key by key (`resume_differences`; only RESUME_MUTABLE_KEYS may change).
- Sections: model (trainer ModelSection; float32 compute only), task (name, prompts per step,
  samples per prompt G), sampling (temperature, top_p, top_k, max_new_tokens), loss (clip_eps,
  kl_coef: the k3 KL to the frozen initial policy), optimizer, schedule, rollout (lag, buffer),
  parallel (threads, backend; data parallel only), checkpoint, audit, determinism
  (batch_invariant on by default: the zero-gap guarantee needs it), logging (the train loop's:
  metrics.jsonl, TensorBoard); top-level `seed` (prompt sets,
  sampling keys, the deterministic init), `steps` and `verify` (record the per-step zero-gap
  figures; what `titan-audit verify-onpolicy` turns on), `generator` ("builtin": rl/builtin.py;
  "vllm": our model inside vLLM, rl/vllm/, needs the `vllm` extra; the same tokens and log-probs
  in BI mode).
- Recipe `rl-tiny`: tiny-dense, reversal-short, 8 prompts x 8 samples per step, 300 steps, AdamW
  at a constant 6e-4, lag 0, BI mode; start it from the warm-up of recipes/rl-warmup.toml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from titan_audit.rl.tasks import task_names
from titan_audit.trainer import typed_config
from titan_audit.trainer.config import (
    RUN_MUTABLE_KEYS,
    AuditSection,
    CheckpointSection,
    LoggingSection,
    ModelSection,
    ProcessSection,
)
from titan_audit.trainer.optim import OptimizerConfig, ScheduleConfig

# rollout.buffer: how far ahead rollouts may run, not which; generator: builtin and vllm give the
# same samples in BI mode (tests/rl/test_vllm_rl.py)
RESUME_MUTABLE_KEYS = RUN_MUTABLE_KEYS | {"rollout.buffer", "generator"}


@dataclass
class TaskSection:
    name: str = "reversal"  # rl/tasks.py: arithmetic, reversal, sorting, copy, mixed
    prompts_per_step: int = 8  # P: prompts per step = virtual microbatches V (one prompt group each)
    samples_per_prompt: int = 8  # G: samples per prompt (the GRPO group)

    def __post_init__(self) -> None:
        if self.name not in task_names():
            raise ValueError(f"task.name: unknown task {self.name!r}; choose from {', '.join(task_names())}")
        for key in ("prompts_per_step", "samples_per_prompt"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class SamplingSection:
    temperature: float = 1.0  # > 0; the generator reports log-probs of the tempered distribution
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.temperature > 0 or self.temperature == float("inf"):
            raise ValueError(f"sampling.temperature must be a finite number > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class LossSection:
    clip_eps: float = 0.2  # PPO clip range of the importance ratio
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial policy (0: no reference model)
    adv_eps: float = 1e-6  # advantage = (r - mean) / (std + adv_eps) within a prompt group

    def __post_init__(self) -> None:
        if not self.clip_eps > 0:
            raise ValueError(f"loss.clip_eps must be > 0, got {self.clip_eps}")
        if self.kl_coef < 0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.adv_eps > 0:
            raise ValueError(f"loss.adv_eps must be > 0, got {self.adv_eps}")


@dataclass
class RolloutSection:
    lag: int = 0  # rollouts of step k come from the weights after step k - 1 - lag (0: on-policy)
    buffer: int = 4  # most steps of rollouts (and weight snapshots) held ahead; lag <= buffer

    def __post_init__(self) -> None:
        if self.lag < 0:
            raise ValueError(f"rollout.lag must be >= 0, got {self.lag}")
        if self.buffer < 0:
            raise ValueError(f"rollout.buffer must be >= 0, got {self.buffer}")
        if self.lag > self.buffer:
            raise ValueError(
                f"rollout.lag = {self.lag} is larger than rollout.buffer = {self.buffer} "
                f"(the steps of rollouts held ahead); raise rollout.buffer or lower the lag"
            )


@dataclass
class RLDeterminismSection:
    strict: bool = True
    batch_invariant: bool = True  # G4 needs it; false: native ops (the --compare-default control)
    census: Literal["record", "strict", "off"] = "record"  # BI op census: count native ops, or stop at one

    @property
    def enabled(self) -> bool:
        """An RL run is always deterministic (the train loop's `determinism.enabled` can be false)."""
        return True


@dataclass
class RLConfig:
    seed: int = 0
    steps: int = 100
    verify: bool = False  # record the per-step zero-gap figures (verify-onpolicy)
    generator: Literal["builtin", "vllm"] = "builtin"  # rollouts: rl/builtin.py or vLLM (rl/vllm/)
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    loss: LossSection = field(default_factory=LossSection)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=0, min_lr_ratio=1.0))
    rollout: RolloutSection = field(default_factory=RolloutSection)
    parallel: ProcessSection = field(default_factory=ProcessSection)  # data parallel only
    checkpoint: CheckpointSection = field(default_factory=lambda: CheckpointSection(interval=10, keep_last=2))
    audit: AuditSection = field(default_factory=AuditSection)
    determinism: RLDeterminismSection = field(default_factory=RLDeterminismSection)
    logging: LoggingSection = field(default_factory=LoggingSection)  # metrics.jsonl, TensorBoard

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.model.compute_dtype != "float32":
            raise ValueError(f"model.compute_dtype: RL runs in float32, got {self.model.compute_dtype!r}")
        if self.model.activation_checkpointing:
            raise ValueError("model.activation_checkpointing is not supported by the RL loop")

    @property
    def num_microbatches(self) -> int:
        return self.task.prompts_per_step

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless W divides P (each rank serves a whole block of prompt ids)."""
        p = self.task.prompts_per_step
        if world_size < 1 or p % world_size:
            raise ValueError(
                f"world size {world_size} does not divide task.prompts_per_step = {p}; "
                f"use W in {[w for w in range(1, p + 1) if p % w == 0]}"
            )


RECIPES: dict[str, dict[str, Any]] = {
    "rl-tiny": {
        "steps": 300,
        "model": {"preset": "tiny-dense"},
        "task": {"name": "reversal-short", "prompts_per_step": 8, "samples_per_prompt": 8},
        "sampling": {"temperature": 1.0, "max_new_tokens": 16},
        "optimizer": {"lr": 6e-4, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"warmup_steps": 0, "min_lr_ratio": 1.0},
        "checkpoint": {"interval": 10, "keep_last": 2},
    },
}


def from_dict(data: dict[str, Any], where: str = "") -> RLConfig:
    return typed_config.build(RLConfig, data, where)


def to_dict(config: RLConfig) -> dict[str, Any]:
    return typed_config.to_dict(config)


def load_rl_config(source: str, overrides: list[str] | tuple[str, ...] = ()) -> RLConfig:
    """A recipe name or a TOML file (which may name a base recipe with `recipe = "..."`), then
    `--set` overrides. Errors name the key and the file."""
    return typed_config.load(RLConfig, source, RECIPES, overrides, what="RL recipe")


def resume_differences(saved: dict[str, Any], current: RLConfig) -> list[str]:
    """Dotted keys whose values differ between a run's saved config and `current`, other than
    RESUME_MUTABLE_KEYS (see `typed_config.resume_differences`). Empty: the resume is allowed."""
    return typed_config.resume_differences(saved, current, RESUME_MUTABLE_KEYS)
