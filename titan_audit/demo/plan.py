"""What `titan-audit demo` runs: the recipes, the step counts and which controls, fixed by --quick.

Guarantees: `Plan.make(quick)` is the whole difference between the quick and the full demo (fewer
steps, fewer head dims, no torchrun control and no native-ops RL run with --quick); every stage
reads its sizes from the plan, none hard-codes its own.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

RECIPE, RL_RECIPE = "tiny-dense", "rl-tiny"
DEMO_FILE = "demo.json"


def default_out_dir() -> Path:
    return Path("runs") / dt.datetime.now(dt.UTC).strftime("demo-%Y%m%dT%H%M%SZ")


@dataclass
class Plan:
    quick: bool
    steps: int
    head_dims: tuple[int, ...]
    rl_steps: int
    rl_overrides: tuple[str, ...]
    controls: bool  # not with --quick: the G3 control (a torchrun start) and the reported native-ops RL run

    @property
    def checkpoint_step(self) -> int:
        return self.steps // 2

    @classmethod
    def make(cls, quick: bool) -> Plan:
        rl = (
            "task.prompts_per_step=4",
            "task.samples_per_prompt=4",
            "sampling.max_new_tokens=8",
            "checkpoint.interval=0",
        )
        if quick:
            return cls(True, 4, (64, 128), 2, rl, controls=False)
        return cls(False, 8, (64, 96, 128, 256), 4, rl, controls=True)

    def train_overrides(self) -> list[str]:
        return [f"steps={self.steps}", "audit.level=full", f"checkpoint.interval={self.checkpoint_step}"]
