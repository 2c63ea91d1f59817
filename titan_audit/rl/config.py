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
  samples per prompt G; or the user's prompts file and reward functions, rl/user_task.py),
  tokenizer (the byte tokenizer, or an HF tokenizer file / directory), sampling (temperature,
  top_p, top_k, max_new_tokens), loss (clip_eps,
  kl_coef: the k3 KL to the frozen initial policy), optimizer, schedule, rollout (lag, buffer),
  parallel (threads, backend, tp: the trainer's tensor-parallel degree, mode: "dp" or "fsdp", the
  trainer's FSDP2 with the policy and its KL reference sharded, rl/init.py), checkpoint, audit,
  determinism (batch_invariant on by default: the zero-gap guarantee needs it; bi_kernels: the
  gemm order, "v2" default, the trainer's and the generator's alike), logging (the train loop's:
  metrics.jsonl, TensorBoard); top-level `seed` (prompt sets,
  sampling keys, the deterministic init), `steps` and `verify` (record the per-step zero-gap
  figures; what `titan-audit verify-onpolicy` turns on), `generator` ("builtin": rl/builtin.py;
  "vllm": our model inside vLLM, rl/vllm/, needs the `vllm` extra; the same tokens and log-probs
  in BI mode), `control` (unset by default; "generator-weight-ulp": the constructed G4 control of
  rl/control.py, the generator sent the trainer's weights with one element one ulp off, so the
  zero-gap check must report a gap; needs `verify`).
- Recipe `rl-tiny`: tiny-dense, reversal-short, 8 prompts x 8 samples per step, 300 steps, AdamW
  at a constant 6e-4, lag 0, BI mode; start it from the warm-up of recipes/rl-warmup.toml.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_audit.rl.control import Control, check_control
from titan_audit.rl.tasks import task_names
from titan_audit.trainer import typed_config
from titan_audit.trainer.config import (
    RUN_MUTABLE_KEYS,
    AuditSection,
    CheckpointSection,
    LoggingSection,
    ModelSection,
    ParallelSection,
)
from titan_audit.trainer.optim import OptimizerConfig, ScheduleConfig

# rollout.buffer: how far ahead rollouts may run, not which; generator: builtin and vllm give the
# same samples in BI mode (tests/rl/test_vllm_rl.py)
RESUME_MUTABLE_KEYS = RUN_MUTABLE_KEYS | {"rollout.buffer", "generator", "parallel.tp"}


def _absolute(path: str) -> str:
    """A relative path resolved against the current directory (configs store absolute paths)."""
    return os.path.abspath(os.path.expanduser(path))


def _absolute_reward(spec: str) -> str:
    """'module:fn' as given; 'path/to/file.py:fn' with the file made absolute."""
    where, sep, fn = spec.rpartition(":")
    if not sep or not where or not fn:
        raise ValueError(f"task.reward {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    return f"{_absolute(where)}:{fn}" if where.endswith(".py") or "/" in where else spec


@dataclass
class TaskSection:
    """A built-in task (`name`), or the user's own: a prompts file and reward function(s).

    prompts: a .jsonl or .parquet file, one prompt a row (column `prompt_column`); every other
    column reaches the reward functions under its own name. Relative paths (prompts, a reward's
    file, tokenizer.path) resolve against the current directory when the config is built and are
    stored absolute. reward / rewards: 'module:function' or 'path/to/file.py:function' (one of the
    two keys), TRL's signature fn(prompts, completions, **columns) -> list[float]; the reward is
    the sum of reward_weights[i] * rewards[i] (default weights 1.0). shuffle: each epoch over the
    rows in a keyed permuted order (else file order). reward_check: score the first prompt group
    of each step (per rank) twice and stop on a difference (NondeterministicRewardError)."""

    name: str = "reversal"  # rl/tasks.py: arithmetic, reversal, sorting, copy, mixed (unused with prompts)
    prompts_per_step: int = 8  # P: prompts per step = virtual microbatches V (one prompt group each)
    samples_per_prompt: int = 8  # G: samples per prompt (the GRPO group)
    prompts: str | None = None  # the user's prompts file (rl/user_task.py); None: the built-in task `name`
    prompt_column: str = "prompt"
    shuffle: bool = True
    reward: str | None = None
    rewards: list[str] | None = None
    reward_weights: list[float] | None = None
    reward_check: bool = True

    def __post_init__(self) -> None:
        if self.name not in task_names():
            raise ValueError(f"task.name: unknown task {self.name!r}; choose from {', '.join(task_names())}")
        for key in ("prompts_per_step", "samples_per_prompt"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.{key} must be >= 1, got {getattr(self, key)}")
        if self.reward is not None and self.rewards is not None:
            raise ValueError("task.reward and task.rewards exclude each other (rewards: a list of several)")
        if self.rewards is not None and not self.rewards:
            raise ValueError("task.rewards is empty; name at least one 'module:function'")
        if self.prompts is None:
            for key in ("reward", "rewards", "reward_weights"):
                if getattr(self, key) is not None:
                    raise ValueError(f"task.{key} needs task.prompts (the user's prompts file)")
            return
        if self.reward is None and self.rewards is None:
            raise ValueError("task.prompts needs task.reward = 'module:function' (or task.rewards = [...])")
        if not self.prompt_column:
            raise ValueError("task.prompt_column is empty")
        self.prompts = _absolute(self.prompts)
        if self.reward is not None:
            self.reward = _absolute_reward(self.reward)
        if self.rewards is not None:
            self.rewards = [_absolute_reward(r) for r in self.rewards]
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_specs):
            raise ValueError(
                f"task.reward_weights has {len(self.reward_weights)} weights for "
                f"{len(self.reward_specs)} reward functions"
            )

    @property
    def reward_specs(self) -> list[str]:
        return [self.reward] if self.reward is not None else list(self.rewards or [])

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_specs)


@dataclass
class TokenizerSection:
    """path: None = the byte tokenizer (EOS 256, vocab 258); a tokenizer.json (HF `tokenizers`) or
    an HF tokenizer directory (transformers). chat_template: apply the tokenizer's chat template
    (add_generation_prompt) to every prompt (a directory's tokenizer only). eos_token / pad_token:
    their tokens by name (default: the tokenizer's own; PAD falls back to EOS)."""

    path: str | None = None
    chat_template: bool = False
    eos_token: str | None = None
    pad_token: str | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = _absolute(self.path)
        elif self.chat_template or self.eos_token is not None or self.pad_token is not None:
            raise ValueError("tokenizer.chat_template / eos_token / pad_token need tokenizer.path (an HF tokenizer)")


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
    batch_invariant: bool = True  # G4 needs it; false: native ops (verify-onpolicy --compare-default)
    census: Literal["record", "strict", "off"] = "record"  # BI op census: count native ops, or stop at one
    # gemm summation order of BI mode (batch_invariant/order.py): "v2" the blocked halving tree
    # (TP shards reproduce it), "v1" one fma chain over K (the order of runs and goldens recorded
    # before v2: a saved config without this key reads as "v1")
    bi_kernels: Literal["v1", "v2"] = "v2"
    # order of the clip norm's sum (trainer/grad_norm.py): "v2" row by row, "v1" one sum over the
    # whole flat gradient (runs recorded before v2: a saved config without this key reads as "v1")
    grad_norm: Literal["v1", "v2"] = "v2"

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
    control: Control | None = None  # the constructed G4 control (rl/control.py); None: a normal run
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    loss: LossSection = field(default_factory=LossSection)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_steps=0, min_lr_ratio=1.0))
    rollout: RolloutSection = field(default_factory=RolloutSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)  # dp x tp, mode (the generator: TP=1)
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
        check_control(self.control)
        if self.control is not None and not self.verify:
            raise ValueError(
                f"control = {self.control!r} needs verify = true: the control run exists to show the "
                f"zero-gap check a gap (titan-audit verify-onpolicy --control runs it)"
            )

    @property
    def num_microbatches(self) -> int:
        return self.task.prompts_per_step

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless dp = W / parallel.tp divides P (each dp rank serves a whole block of
        prompt ids; its TP ranks serve the same one)."""
        p, dp = self.task.prompts_per_step, self.parallel.data_parallel_size(world_size)
        if p % dp:
            what = f"world size {world_size}" if dp == world_size else f"dp = {dp} (world size {world_size} / tp)"
            raise ValueError(
                f"{what} does not divide task.prompts_per_step = {p}; "
                f"use dp in {[w for w in range(1, p + 1) if p % w == 0]}"
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
