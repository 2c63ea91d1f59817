"""Timing and reporting shared by every bench suite.

Timing method: a callable is run in batches long enough to dwarf the timer (>= `min_batch_s`);
the per-call time is the minimum over `repeats` batches, baseline and candidate interleaved batch
by batch so that machine noise hits both alike. The garbage collector is off while timing.

Targets: a case may carry one (ratio <= target is met). The JSON summary counts the cases with a
target (`targets`) and names those that missed (`missed`); `check_targets` is `bench --check`:
the missed cases, and a ValueError when no case had a target (a check never passes on nothing).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemoryGrid:
    """Suite memory's points (bench/memory_suite.py): every mode x W x V with W dividing V, on the
    ~50M-parameter tiny-dense variant ("50m") or tiny-dense itself ("tiny"), `steps` training steps each."""

    modes: tuple[str, ...] = ("dp", "fsdp")
    world_sizes: tuple[int, ...] = (1, 2, 4)
    microbatches: tuple[int, ...] = (2, 4, 8, 16)
    model: str = "50m"
    steps: int = 2

    def __post_init__(self) -> None:
        if not self.modes or any(m not in ("dp", "fsdp") for m in self.modes):
            raise ValueError(f"memory modes must be 'dp' and/or 'fsdp', got {list(self.modes)}")
        for name in ("world_sizes", "microbatches"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"memory {name} must be numbers >= 1, got {list(values)}")
        if not any(v % w == 0 for w in self.world_sizes for v in self.microbatches):
            raise ValueError(
                f"no memory point: no world size in {list(self.world_sizes)} divides a number of "
                f"microbatches in {list(self.microbatches)}"
            )
        if self.model not in ("50m", "tiny"):
            raise ValueError(f"memory model must be '50m' or 'tiny', got {self.model!r}")
        if self.steps < 1:
            raise ValueError(f"memory steps must be >= 1, got {self.steps}")


@dataclass(frozen=True)
class BenchOptions:
    quick: bool = False  # small sizes and few repeats: for smoke tests, not for figures
    repeats: int = 5
    min_batch_s: float = 0.02
    threads: int | None = None  # intra-op threads for the run (both sides); None: torch's current
    generator: str = "builtin"  # suite generate: "builtin" or "vllm" (bench/generate_suite.py)
    memory: MemoryGrid | None = None  # suite memory: its points (None: the suite's default grid)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.min_batch_s <= 0:
            raise ValueError(f"min_batch_s must be > 0, got {self.min_batch_s}")
        if self.generator not in ("builtin", "vllm"):
            raise ValueError(f"generator must be 'builtin' or 'vllm', got {self.generator!r}")


@dataclass
class Case:
    case: str
    baseline: str
    candidate: str
    baseline_s: float
    candidate_s: float
    ratio: float
    target: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def met_target(self) -> bool | None:
        return None if self.target is None else self.ratio <= self.target

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        extra = out.pop("extra")
        out["met_target"] = self.met_target
        out.update(extra)
        return out


@dataclass
class SuiteResult:
    suite: str
    machine: dict[str, Any]
    cases: list[Case]

    def to_dict(self) -> dict[str, Any]:
        ratios = [c.ratio for c in self.cases]
        return {
            "suite": self.suite,
            "machine": self.machine,
            "cases": [c.to_dict() for c in self.cases],
            "summary": {
                "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                "max_ratio": max(ratios) if ratios else None,
                "targets": sum(c.target is not None for c in self.cases),
                "targets_missed": len(self.missed()),
                "missed": self.missed(),
            },
        }

    def missed(self) -> list[str]:
        """The names of the cases that missed their target, in run order."""
        return [c.case for c in self.cases if c.met_target is False]


def check_targets(result: SuiteResult) -> list[str]:
    """`bench --check`: the cases that missed their target ([]: every target met); ValueError when
    no case of the suite had a target, so there was nothing to check."""
    if not any(c.target is not None for c in result.cases):
        raise ValueError(f"bench {result.suite}: no case has a target; --check has nothing to check")
    return result.missed()


def _calibrate(fn: Callable[[], object], min_batch_s: float) -> int:
    """Smallest power-of-two call count whose batch takes at least min_batch_s."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= min_batch_s or calls >= 1 << 20:
            return calls
        calls *= 2


def _batch_time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_interleaved(
    fns: list[Callable[[], object]],
    options: BenchOptions,
    modes: list[Callable[[], contextlib.AbstractContextManager] | None] | None = None,
) -> list[float]:
    """Per-call seconds of each fn: min over `repeats` batches, the fns interleaved batch by batch.

    modes[i] (optional): a context manager factory entered around each of fn i's batches (and its
    calibration), outside the timing: the state a side runs in for a whole run, such as the
    batch-invariant mode an RL run installs once (`batch_invariant.enabled()`), which a side that
    alternates with a native side would otherwise install and remove on every call."""
    modes = modes or [None] * len(fns)
    assert len(modes) == len(fns), (len(modes), len(fns))

    def mode(i: int) -> contextlib.AbstractContextManager:
        return modes[i]() if modes[i] is not None else contextlib.nullcontext()

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        calls = []
        for i, fn in enumerate(fns):
            with mode(i):
                calls.append(_calibrate(fn, options.min_batch_s))
        best = [math.inf] * len(fns)
        for _ in range(options.repeats):
            for i, fn in enumerate(fns):
                with mode(i):
                    best[i] = min(best[i], _batch_time(fn, calls[i]))
        return best
    finally:
        if gc_was_enabled:
            gc.enable()


def compare(
    case: str,
    baseline: tuple[str, Callable[[], object]],
    candidate: tuple[str, Callable[[], object]],
    options: BenchOptions,
    *,
    target: float | None = None,
    others: dict[str, Callable[[], object]] | None = None,
) -> Case:
    """Time baseline and candidate (and any `others`, reported as `<name>_s` extra keys)."""
    others = others or {}
    times = time_interleaved([baseline[1], candidate[1], *others.values()], options)
    extra = {f"{name}_s": t for name, t in zip(others, times[2:])}
    return Case(
        case=case,
        baseline=baseline[0],
        candidate=candidate[0],
        baseline_s=times[0],
        candidate_s=times[1],
        ratio=times[1] / times[0],
        target=target,
        extra=extra,
    )
