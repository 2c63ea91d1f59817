"""Readers for the run report: what kind of run a directory holds and the facts the report shows.

Guarantees:
- Only reads: nothing here writes into a run directory.
- `run_kind(path)` is "demo" (DIR/demo.json written by `titan-audit demo`), "rl" (manifest kind
  rl), "train" (any other manifest) and a ValueError naming the path otherwise (missing, not a
  directory, no manifest.json and no demo.json), so a bad RUN is one line, exit 2.
- `coverage(run)` counts the audit records as written (rows) and as unique comparison keys
  (step, phase, microbatch, name): a resumed run that replayed steps holds repeats, and the two
  figures say so; `repeated_with_other_hash` counts keys recorded more than once with different
  hashes (what `compare` calls a conflict), which a faithful resume never produces.
- `replays(run)` finds the elastic replays of a run (`titan-audit replay`: a manifest with
  `replay_of`) among the run's siblings, and the run itself when it is one, and compares each over
  the replayed steps with trainer.replay.compare_replay (bitwise, nothing ignored).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from titan_audit.audit import run_metrics
from titan_audit.audit.log import AUDIT_DIR, part_files, read_audit_log
from titan_audit.audit.run_manifest import MANIFEST, read_manifest
from titan_audit.audit.schema import KEY, PHASES

DEMO_FILE = "demo.json"

# what each phase's records fingerprint (audit/recorder.py, rl/loop.py)
PHASE_MEANING = {
    "rollout": "generator weights digest, prompt/completion tokens, generator log-probs, rewards, advantages",
    "data": "each virtual microbatch's input tensors (tokens, targets, positions, masks, document ids)",
    "forward": "every selected module's forward output, per microbatch",
    "logprob": "the trainer's recomputed log-probs of the sampled tokens",
    "loss": "each microbatch's loss",
    "backward": "the gradient of every selected module's output, per microbatch",
    "grad": "every parameter's reduced gradient (after the tree reduction)",
    "optim": "every optimizer state tensor (AdamW exp_avg, exp_avg_sq, step)",
    "param": "every parameter after the update",
    "ckpt": "checkpoint tensors",
}


def run_kind(path: str | os.PathLike) -> str:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such run directory")
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory (expected a run directory)")
    if (path / DEMO_FILE).is_file():
        return "demo"
    if not (path / MANIFEST).is_file():
        raise ValueError(f"{path}: not a run directory ({MANIFEST} or {DEMO_FILE} not found)")
    return "rl" if read_manifest(path).get("kind") == "rl" else "train"


def read_demo(path: str | os.PathLike) -> dict[str, Any]:
    file = Path(path) / DEMO_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: not a readable demo summary ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{file}: not a demo summary (no rows)")
    return data


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The run's metrics rows (one per step: audit.run_metrics), [] when it has none yet."""
    table = run_metrics.read_metrics(run)
    return [] if table is None else table.to_pylist()


@dataclass
class PhaseCoverage:
    phase: str
    records: int
    unique_keys: int
    steps: int
    names: int
    microbatches: int
    ranks: list[int]
    dtypes: list[str]
    examples: list[str]
    meaning: str


@dataclass
class Coverage:
    records: int
    unique_keys: int
    repeated_with_other_hash: int
    steps: list[int]
    parts: int
    phases: list[PhaseCoverage]
    per_step: dict[str, dict[int, int]]  # phase -> step -> records
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


def coverage(run: str | os.PathLike) -> Coverage | None:
    """What the run's audit log holds (see the module docstring); None when it has no audit log."""
    run = Path(run)
    if not (run / AUDIT_DIR).is_dir():
        return None
    table = read_audit_log(run, columns=[*KEY, "hash", "dtype", "rank"])
    phases: list[PhaseCoverage] = []
    per_step: dict[str, dict[int, int]] = {}
    for phase in PHASES:
        sub = table.filter(pc.equal(table["phase"], phase))
        if sub.num_rows == 0:
            continue
        keys = sub.group_by(list(KEY)).aggregate([])
        names = sorted(set(sub["name"].to_pylist()))
        counts = sub.group_by("step").aggregate([("name", "count")]).to_pylist()
        per_step[phase] = {int(r["step"]): int(r["name_count"]) for r in counts}
        phases.append(
            PhaseCoverage(
                phase=phase,
                records=sub.num_rows,
                unique_keys=keys.num_rows,
                steps=len(pc.unique(sub["step"])),
                names=len(names),
                microbatches=len([m for m in pc.unique(sub["microbatch"]).to_pylist() if m >= 0]),
                ranks=sorted(pc.unique(sub["rank"]).to_pylist()),
                dtypes=sorted(pc.unique(sub["dtype"]).to_pylist()),
                examples=names[:4],
                meaning=PHASE_MEANING.get(phase, ""),
            )
        )
    unique = table.group_by(list(KEY)).aggregate([("hash", "count_distinct")]) if table.num_rows else None
    conflicts = 0 if unique is None else int(pc.sum(pc.greater(unique["hash_count_distinct"], 1)).as_py() or 0)
    steps = sorted(pc.unique(table["step"]).to_pylist()) if table.num_rows else []
    return Coverage(
        records=table.num_rows,
        unique_keys=0 if unique is None else unique.num_rows,
        repeated_with_other_hash=conflicts,
        steps=steps,
        parts=len(part_files(run)),
        phases=phases,
        per_step=per_step,
        checkpoints=checkpoints(run),
    )


def checkpoints(run: Path) -> list[dict[str, Any]]:
    """Each complete checkpoint: step and how many tensor hashes its hashes.json holds."""
    out = []
    directory = run / "checkpoints"
    if not directory.is_dir():
        return out
    for ckpt in sorted(directory.iterdir()):
        if not (ckpt.is_dir() and ckpt.name.startswith("step_")):
            continue
        entry: dict[str, Any] = {"step": int(ckpt.name.removeprefix("step_")), "path": str(ckpt), "hashes": None}
        hashes = ckpt / "hashes.json"
        try:
            entry["hashes"] = len(json.loads(hashes.read_text()).get("tensors", {}))
        except (OSError, ValueError, AttributeError):
            entry["hashes"] = None
        out.append(entry)
    return out


def starts(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The manifest's world-size history: one entry per start or resume."""
    history = read_manifest(run).get("world_size_history") or []
    return [h for h in history if isinstance(h, dict)]


@dataclass
class ReplayVerdict:
    run: str
    replay: str
    from_step: int
    to_step: int
    world_size: int | None
    identical: bool
    compared: int
    differing: int
    one_side_only: int
    first_divergence: dict[str, Any] | None
    error: str | None = None


def _last_step(run: Path) -> int | None:
    try:
        table = read_audit_log(run, columns=["step"])
    except ValueError:
        return None
    return int(pc.max(table["step"]).as_py()) if table.num_rows else None


def replay_verdict(source: Path, replay: Path, from_step: int) -> ReplayVerdict:
    from titan_audit.trainer.replay import compare_replay

    history = starts(replay)
    world = history[-1].get("world_size") if history else None
    last = _last_step(replay)
    if last is None or last <= from_step:
        return ReplayVerdict(
            str(source),
            str(replay),
            from_step,
            from_step,
            world,
            False,
            0,
            0,
            0,
            None,
            error="the replay recorded no step after its checkpoint",
        )
    try:
        result = compare_replay(source, replay, from_step, last)
    except ValueError as error:
        return ReplayVerdict(str(source), str(replay), from_step, last, world, False, 0, 0, 0, None, error=str(error))
    return ReplayVerdict(
        str(source),
        str(replay),
        from_step,
        last,
        world,
        result.identical,
        result.compared,
        result.differing,
        result.only_in_a + result.only_in_b,
        result.first_divergence,
    )


def replays(run: str | os.PathLike) -> list[ReplayVerdict]:
    """Replays of `run` next to it, and `run` itself compared with its source when it is a replay."""
    run = Path(run)
    found: list[ReplayVerdict] = []
    me = run.resolve()
    own = read_manifest(run).get("replay_of")
    if isinstance(own, dict) and own.get("run") and Path(own["run"]).is_dir():
        found.append(replay_verdict(Path(own["run"]), run, int(own["from_step"])))
    parent = run.parent
    for sibling in sorted(parent.iterdir()) if parent.is_dir() else []:
        if sibling.resolve() == me or not (sibling / MANIFEST).is_file():
            continue
        try:
            of = read_manifest(sibling).get("replay_of")
        except ValueError:
            continue
        if isinstance(of, dict) and of.get("run") and Path(of["run"]).resolve() == me:
            found.append(replay_verdict(run, sibling, int(of["from_step"])))
    return found
