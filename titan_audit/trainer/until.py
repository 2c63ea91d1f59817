"""Stop a training run at a skill level instead of a step count: `train --until "reward>=0.24"`.

    until = parse_until("reward>=0.24,task=reversal-short,every=25")   # UntilConfig
    stopper = Stopper(until)          # Stopper(None): never evaluates, never stops
    for step in stopper.steps(run):   # run.steps(), ended early once the condition holds

The spec is `METRIC OP VALUE[,key=value...]`: OP is `>=` or `<=`; the keys are those of
UntilConfig. The metric comes from an evaluator module named by `evaluator` (module path), which
provides check(until, config) and evaluate(until, model, seed, batch_invariant) -> float. The
default, titan_audit.rl.skill, samples a built-in RL task on held-out prompts through the built-in
generator (metrics `reward`, the mean reward, and `accuracy`, the fraction of exact answers; its
docstring says what it guarantees). It is imported by name when a run has a condition, so this
layer does not import the rl layer above it.

Guarantees:
- The metric is evaluated after the update of every step that is a multiple of `every` (absolute
  step numbers, so a resume evaluates at the same steps), on the weights after that update, with
  the run's seed and BI mode. Every rank computes it and rank 0's value reaches every rank, so all
  ranks stop together. The first evaluation whose value meets the condition ends the run after
  that step, with a checkpoint there.
- Recorded: every metrics row of such a run has `until_value` (the metric, None off evaluation
  steps) and `until_stop`; the manifest holds the spec (`until`); the stop step's checkpoint blob
  holds {"until": {"stopped": true, "step", "value"}}. A resume runs with the recorded spec (a
  different one given is refused), and a resume of a run that stopped is refused: nothing to run.
- User errors (a bad spec; the evaluator's: an unknown task, a corpus it cannot read) are
  ValueErrors naming `--until` and the key.
"""

from __future__ import annotations

import importlib
import math
import operator
import re
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from titan_audit.log import get_logger

log = get_logger(__name__)
_SPEC = re.compile(r"^\s*([a-z_]+)\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")
_OPS = {">=": operator.ge, "<=": operator.le}
DEFAULT_EVALUATOR = "titan_audit.rl.skill"


@dataclass(frozen=True)
class UntilConfig:
    """metric op threshold; task: the evaluator's task (the default's: a built-in RL task); every:
    evaluate after each step divisible by it; prompts x samples: the held-out prompts and samples
    per prompt; temperature, max_new_tokens: the sampling; evaluator: the module that measures."""

    metric: str
    op: str
    threshold: float
    task: str = "reversal-short"
    every: int = 25
    prompts: int = 64
    samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 16
    evaluator: str = DEFAULT_EVALUATOR

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"--until: operator {self.op!r}; use >= or <=")
        if not math.isfinite(self.threshold):
            raise ValueError(f"--until: threshold {self.threshold!r} is not a finite number")
        for key in ("every", "prompts", "samples", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"--until {key}={getattr(self, key)}: must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"--until temperature={self.temperature}: must be a finite number > 0")

    def describe(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g} ({self.task}, every {self.every} steps)"


def parse_until(spec: str) -> UntilConfig:
    """`METRIC OP VALUE[,key=value...]` (module docstring) -> UntilConfig, checked by its evaluator
    (without a run config); ValueError naming the part."""
    head, *rest = spec.split(",")
    match = _SPEC.match(head)
    if not match:
        raise ValueError(f"--until {spec!r}: expected METRIC>=VALUE or METRIC<=VALUE, e.g. 'reward>=0.24'")
    metric, op, value = match.groups()
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(f"--until {spec!r}: {value!r} is not a number") from None
    types = {f.name: f.type for f in fields(UntilConfig)}
    options: dict[str, Any] = {}
    for part in rest:
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or key not in types or key in ("metric", "op", "threshold"):
            known = ", ".join(k for k in types if k not in ("metric", "op", "threshold"))
            raise ValueError(f"--until {spec!r}: {part.strip()!r} is not key=value with a key of {known}")
        kind = {"str": str, "int": int, "float": float}[types[key]]
        try:
            options[key] = kind(text.strip())
        except ValueError:
            raise ValueError(f"--until {key}={text.strip()!r}: not a {types[key]}") from None
    until = UntilConfig(metric, op, threshold, **options)
    evaluator(until).check(until, None)
    return until


def evaluator(until: UntilConfig) -> ModuleType:
    """The evaluator module of `until` (module docstring), imported by name."""
    try:
        module = importlib.import_module(until.evaluator)
    except ImportError as error:
        raise ValueError(f"--until evaluator={until.evaluator!r}: cannot import it ({error})") from None
    if not (callable(getattr(module, "check", None)) and callable(getattr(module, "evaluate", None))):
        raise ValueError(f"--until evaluator={until.evaluator!r}: has no check(until, config) and evaluate(...)")
    return module


class Stopper:
    """A run's stop condition (or none): evaluation, decision, records (module docstring)."""

    def __init__(self, until: UntilConfig | str | None) -> None:
        self.until = parse_until(until) if isinstance(until, str) else until
        self.stopped = False
        self.value: float | None = None  # the last evaluation's
        self.step: int | None = None  # the step it followed

    def record(self) -> dict[str, Any]:
        """The manifest keys of a new run."""
        return {} if self.until is None else {"until": asdict(self.until)}

    def start(self, run, blob: dict | None) -> None:
        """After `run.restore`: take the recorded spec on a resume (refusing another one), refuse
        a run that already stopped, check the spec against the run's config (its evaluator's check)."""
        recorded = run.manifest.get("until")
        recorded = None if recorded is None else UntilConfig(**recorded)
        if run.resume and recorded != self.until:
            if self.until is not None or recorded is None:
                given = "none" if self.until is None else self.until.describe()
                was = "none" if recorded is None else recorded.describe()
                raise ValueError(f"{run.out}: the run was started with --until {was}; this resume gives {given}")
            self.until = recorded  # checked by its evaluator below
        stop = (blob or {}).get("until") or {}
        if stop.get("stopped"):
            raise ValueError(
                f"{run.out}: stopped at step {stop['step']} by --until {self.until.describe()} "
                f"({self.until.metric} {stop['value']:.4f}); nothing to run (start a new run with --init {run.out})"
            )
        if self.until is not None:
            evaluator(self.until).check(self.until, run.config)

    def steps(self, run):
        """run.steps(), ending after the step at which the condition held."""
        for step in run.steps():
            yield step
            if self.stopped:
                return

    def after_step(self, run, step: int, model: torch.nn.Module) -> dict[str, Any]:
        """Evaluate when due; on a stop, make `step` the run's last (end_step checkpoints it). The
        metrics row's keys (none without a condition)."""
        if self.until is None:
            return {}
        value = None
        if step % self.until.every == 0:
            config = run.config
            value = evaluator(self.until).evaluate(self.until, model, config.seed, config.determinism.batch_invariant)
            if dist.is_initialized():  # rank 0's value decides for every rank
                box = [value]
                dist.broadcast_object_list(box, src=0)
                value = box[0]
            self.value, self.step = value, step
            self.stopped = bool(_OPS[self.until.op](value, self.until.threshold))
            if self.stopped:
                run.last_step = step
            if run.mesh.rank == 0 and not run.quiet:
                verdict = "stop" if self.stopped else "go on"
                log.info(
                    "step %d: --until %s: %s %.4f -> %s", step, self.until.describe(), self.until.metric, value, verdict
                )
        return {"until_value": value, "until_stop": self.stopped}

    def blob(self) -> dict[str, Any]:
        """The checkpoint blob's keys: the decision at a stop step."""
        return {"until": {"stopped": True, "step": self.step, "value": self.value}} if self.stopped else {}
