"""`bench memory`: peak memory per rank, measured, beside the formula of docs/memory.md.

Each point (mode, W, V) of the grid (`core.MemoryGrid`; W must divide V, other pairs are left
out) is a real `titan-audit train` launch (torchrun, trainer/rank_entry.py) of `steps` steps with
`live_bytes.ENV_DIR` set, so every rank runs under the live-tensor-bytes tracker and writes its
peaks (titan_audit/live_bytes.py), with the memory policy off (`TITAN_AUDIT_MALLOC=default`,
`THP_MEM_ALLOC_ENABLE=0`: RSS then follows what the process holds instead of its heap's
high-water mark, memory_policy.py). The model: a ~50M-parameter tiny-dense variant
(hidden 512, 4 layers, vocab 32000, intermediate 1536, 8/4 heads; P = 45,356,032), or tiny-dense
itself with `MemoryGrid(model="tiny")`; 1 x 64-token microbatches, global batch V, no checkpoint
but the last, audit at its default level.

A point's case: baseline = the formula's peak per rank (bench/memory_formula.py `estimate`),
candidate = the largest peak of live CPU tensor bytes over the ranks; ratio = measured / formula,
met inside [BAND_LOW, BAND_HIGH] (within 15%). Extra keys: the formula's terms, each rank's
peak, the op after which the largest was reached and where in our code, peak RSS (max over ranks,
and each rank's), the same-host exchange file (mapped, once per host) measured and predicted,
seconds.
Two more cases when the grid holds their points (the memory goals), ratio <= 1 met:
- `dp W=1: peak(V=16) - peak(V=2)` against 3 x 4P (at most three more gradient copies) and
  DP_GROWTH_DATA bytes per extra microbatch (its token batches and small tensors, ~2 KB each);
- `fsdp V=8: peak(W=4)` against 0.45 x peak(W=1) (memory per rank shrinks with W).
A case's sides are bytes: its JSON says `baseline_bytes` / `candidate_bytes` (`MemoryCase`).
`--quick` (without a grid of its own): `QUICK_GRID`, tiny-dense at W = 2, V = 2, one step, both modes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from titan_audit.bench.core import BenchOptions, Case, MemoryGrid
from titan_audit.bench.memory_formula import FP32, Layout, Shape, estimate, gradient_buffers
from titan_audit.live_bytes import ENV_DIR, MAPPED

MODELS = {
    "50m": [
        "model.overrides.hidden_size=512",
        "model.overrides.num_hidden_layers=4",
        "model.overrides.vocab_size=32000",
        "model.overrides.intermediate_size=1536",
        "model.overrides.num_attention_heads=8",
        "model.overrides.num_key_value_heads=4",
    ],
    "tiny": [],
}
SEQ_LEN = 64
QUICK_GRID = MemoryGrid(modes=("dp", "fsdp"), world_sizes=(2,), microbatches=(2,), model="tiny", steps=1)
BAND_LOW, BAND_HIGH = 0.85, 1.15
MEMORY_POLICY_OFF = {"TITAN_AUDIT_MALLOC": "default", "THP_MEM_ALLOC_ENABLE": "0"}
FORMULA = "formula (docs/memory.md)"
MEASURED = "peak live tensor bytes (max over ranks)"
DP_GROWTH = (1, 2, 16, 3)  # W, V from, V to, bound in gradient copies (4P)
DP_GROWTH_DATA = 4096  # bytes per extra microbatch besides the copies: its batches, loss scalars
FSDP_SHRINK = (8, 1, 4, 0.45)  # V, W from, W to, bound as a fraction


@dataclass
class MemoryCase(Case):
    """A case whose sides are bytes (to_dict: `baseline_bytes`, `candidate_bytes`), met when
    target_low <= ratio <= target (target_low None: ratio <= target)."""

    target_low: float | None = None

    @property
    def met_target(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target and (self.target_low is None or self.ratio >= self.target_low)

    def to_dict(self) -> dict[str, Any]:
        names = {"baseline_s": "baseline_bytes", "candidate_s": "candidate_bytes"}
        return {names.get(k, k): v for k, v in super().to_dict().items()}


def points(grid: MemoryGrid) -> list[tuple[str, int, int]]:
    """(mode, W, V) in run order, every W dividing V."""
    return [(m, w, v) for m in grid.modes for w in grid.world_sizes for v in grid.microbatches if v % w == 0]


def train_config(grid: MemoryGrid, mode: str, microbatches: int) -> Any:
    from titan_audit.trainer.config import load_config

    return load_config(
        "tiny-dense",
        [
            *MODELS[grid.model],
            f"data.seq_len={SEQ_LEN}",
            "data.microbatch_size=1",
            f"data.global_batch_size={microbatches}",
            "checkpoint.interval=0",
            f"parallel.mode='{mode}'",
            f"steps={grid.steps}",
        ],
    )


def measure(config: Any, world_size: int, root: Path) -> list[dict[str, Any]]:
    """Train `config` on `world_size` local ranks under the tracker; every rank's report, in rank
    order (RuntimeError when the launch fails or a rank wrote none)."""
    from titan_audit.trainer.launch import LaunchOptions, launch
    from titan_audit.trainer.train import TRAIN_JOB

    reports = root / "ranks"
    with mock.patch.dict(os.environ, {ENV_DIR: str(reports), **MEMORY_POLICY_OFF}):  # what the ranks inherit
        rc = launch(TRAIN_JOB, config, root / "run", nproc=world_size, options=LaunchOptions(quiet=True))
    if rc != 0:
        raise RuntimeError(f"bench memory: the training launch at W={world_size} failed (exit code {rc})")
    ranks = [json.loads(p.read_text()) for p in sorted(reports.glob("rank-*.json"))]
    ranks.sort(key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(world_size)) or not all(r["completed"] for r in ranks):
        raise RuntimeError(f"bench memory: expected a completed report from each of {world_size} ranks in {reports}")
    return ranks


def point_case(mode: str, world_size: int, microbatches: int, shape: Shape, ranks: list[dict], seconds: float):
    predicted = estimate(shape, Layout(mode, world_size, microbatches, SEQ_LEN))
    peaks = [r["peak_bytes"].get("cpu", 0) for r in ranks]
    top = max(range(len(ranks)), key=peaks.__getitem__)
    measured = peaks[top]
    return MemoryCase(
        case=f"memory {mode} W={world_size} V={microbatches}",
        baseline=FORMULA,
        candidate=MEASURED,
        baseline_s=predicted.peak,
        candidate_s=measured,
        ratio=measured / predicted.peak,
        target=BAND_HIGH,
        target_low=BAND_LOW,
        extra={
            "mode": mode,
            "world_size": world_size,
            "microbatches": microbatches,
            "params": shape.params,
            "gradient_buffers": gradient_buffers(microbatches, world_size),
            "formula": predicted.to_dict(),
            "peak_live_bytes_per_rank": peaks,
            "peak_op": ranks[top]["peak_op"].get("cpu"),
            "peak_where": ranks[top]["peak_where"].get("cpu", []),
            "max_rss_bytes": max(r["max_rss_bytes"] for r in ranks),
            "max_rss_bytes_per_rank": [r["max_rss_bytes"] for r in ranks],
            "exchange_mapped_bytes": max(r["peak_bytes"].get(MAPPED, 0) for r in ranks),
            "exchange_predicted_bytes": predicted.exchange_per_host,
            "memory_policy": ranks[0]["memory_policy"],
            "seconds": seconds,
        },
    )


def relation_cases(measured: dict[tuple[str, int, int], int], shape: Shape) -> list[MemoryCase]:
    """The two relations of the module docstring (DP peak growth with V, FSDP peak shrink with W), for
    those whose points were measured."""
    cases = []
    w, v_from, v_to, copies = DP_GROWTH
    if ("dp", w, v_from) in measured and ("dp", w, v_to) in measured:
        growth = measured[("dp", w, v_to)] - measured[("dp", w, v_from)]
        bound = copies * FP32 * shape.params + (v_to - v_from) * DP_GROWTH_DATA
        cases.append(
            MemoryCase(
                case=f"memory dp W={w}: peak(V={v_to}) - peak(V={v_from})",
                baseline=f"{copies} x 4P + {DP_GROWTH_DATA} bytes per extra microbatch",
                candidate=f"peak(V={v_to}) - peak(V={v_from})",
                baseline_s=bound,
                candidate_s=growth,
                ratio=growth / bound,
                target=1.0,
                extra={"gradient_copies": growth / (FP32 * shape.params)},
            )
        )
    v, w_from, w_to, fraction = FSDP_SHRINK
    if ("fsdp", w_from, v) in measured and ("fsdp", w_to, v) in measured:
        base, peak = measured[("fsdp", w_from, v)], measured[("fsdp", w_to, v)]
        cases.append(
            MemoryCase(
                case=f"memory fsdp V={v}: peak(W={w_to}) vs peak(W={w_from})",
                baseline=f"{fraction} x peak(W={w_from})",
                candidate=f"peak(W={w_to})",
                baseline_s=fraction * base,
                candidate_s=peak,
                ratio=peak / (fraction * base),
                target=1.0,
                extra={"fraction_of_w1": peak / base},
            )
        )
    return cases


def memory_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    grid = options.memory or (QUICK_GRID if options.quick else MemoryGrid())
    shape = Shape.of(train_config(grid, grid.modes[0], max(grid.microbatches)).model.model_config())
    cases: list[Case] = []
    measured: dict[tuple[str, int, int], int] = {}
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-memory-") as tmp:
        for mode, world_size, microbatches in points(grid):
            root = Path(tmp) / f"{mode}-w{world_size}-v{microbatches}"
            start = time.perf_counter()
            ranks = measure(train_config(grid, mode, microbatches), world_size, root)
            case = point_case(mode, world_size, microbatches, shape, ranks, time.perf_counter() - start)
            measured[(mode, world_size, microbatches)] = case.candidate_s
            cases.append(case)
            progress(case.case)
    return [*cases, *relation_cases(measured, shape)]
