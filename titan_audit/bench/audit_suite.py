"""`bench audit`: training-step time with the audit Recorder at `params` and `full` against `off`,
and the bytes an FSDP2 or DDP rank hashes and receives for its records.

One step = forward + backward + AdamW step on one microbatch, with the Recorder calls a trainer
makes (start_step, set_microbatch, record_data, record_loss, record_grads, record_optimizer,
record_params, end_step flushing a Parquet part every FLUSH_EVERY steps). Baseline: the same
step with a Recorder at level `off` (it installs no hook and records nothing). Every side of a
case steps one model instance; the extra key `off_again_ratio` is a second `off` side's time over
the first's: the run's own noise floor, to read the targets against. The suite runs on every
core this process may use (`threads` = its CPU affinity, or --threads): the Recorder hashes a
batch of records on all the intra-op threads, so its cost cannot hide on an idle core. Sides
are interleaved batch by batch, each repeat in one of `balanced_orders` (each side follows each
other side equally often); a side's time is the median over the repeats, at least
MODEL_REPEATS of them for the small-model cases (the ratio of the minima is the extra key
`ratio_of_minima`). The extra key `paired_ratio` (and `off_again_paired_ratio`) is the median
over repeats of the side's time over `off`'s in the same repeat: a shared machine's speed can
drift by tens of percent over a run, and in a pair of batches a fraction of a second apart the
drift cancels.
Records go to a temporary run directory deleted afterwards.

Cases:
- `small-transformer` (a plain `nn.Module` defined here: the Recorder assumes nothing about the
  model) and, unless --quick, the `tiny-dense` preset: params <= 1.03x, full <= 1.10x.
- Unless --quick, real width (`REAL_WIDTH_CASE`: qwen3-0.6b's widths, hidden 1024, intermediate
  3072, 16/8 heads of 128, vocab 151936 tied, with 2 layers, ~187M parameters; 2 x 64 tokens a
  step): one model and one AdamW stepped alternately under a Recorder at off and at params
  (after REAL_WIDTH_WARMUP steps each), at least 3 repeats: params <= 1.10x. Its tensors are
  above C, so its records take the lattice digest (audit/fingerprint.py).
- FSDP2 W=2 against W=1 (spawned gloo ranks, trainer/local_ranks.py, one intra-op thread each):
  tiny-dense widened (FSDP_MODEL; --quick: FSDP_MODEL_QUICK) fully_shard-ed per block and at the
  root, one microbatch per rank per step, a Recorder at params. Per rank, the last step's bytes
  hashed and received by its records (Recorder.counters, audit/exchange.py DigestCounters): the
  case's sides are bytes hashed per step at W=1 and the most any W=2 rank hashed (target 0.6: each
  rank hashes its shard of the tensors above C; the writer also hashes the tensors of at most C,
  gathered to it whole). Extra keys: bytes received per lattice record (5 int64 from the other
  rank), per gathered record, and the calls made to DTensor.full_tensor (0).
- DDP W=2 against W=1: the same model whole on every rank and the same microbatch on each (the
  replicas stay equal), a Recorder with `split_replicated`: each rank hashes its half of the
  dim-0 rows of the tensors above C, the writer alone those of at most C (target 0.6).
- `resume check`: the check a resume makes of the audit log before it appends
  (audit.log.check_audit_log, read-only here so each call reads the same parts) on the log of a
  run killed 25 steps after its checkpoint at step N (`generated_log`: a checkpoint and flush
  every 20 steps, 12 param records per step), N = 10^5 (10^4 with --quick) against N = 20. Target
  1.2: its cost does not grow with the run's length. Extra keys: the parts of the long log, the
  parts and bytes each check reads, and `verify_all_s`, one full read of the long log
  (`titan-audit verify`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash
from torch import nn

from titan_audit.audit import Recorder
from titan_audit.audit.fingerprint import whole_hash_bytes
from titan_audit.audit.log import AuditLogWriter, audit_dir, check_audit_log, encode_part, verify_log
from titan_audit.audit.log_index import PartEntry, ensure_index, part_name
from titan_audit.audit.schema import SCHEMA
from titan_audit.bench.core import BenchOptions, Case, _batch_time, _calibrate, compare

TARGETS = {"params": 1.03, "full": 1.10, "resume": 1.2, "real_width_params": 1.10, "fsdp_hashed": 0.6}
FLUSH_EVERY = 10
# Batches per side of a small-model case (at least; --repeats may ask more): a batch is one
# step of 40-120 ms there, and a median over a few steps moved by +-5% from run to run.
MODEL_REPEATS = 40
REAL_WIDTH_PRESET, REAL_WIDTH_LAYERS = "qwen3-0.6b", 2
REAL_WIDTH_BATCH = (2, 64)  # sequences x tokens per step, as bench train's real-width case
REAL_WIDTH_WARMUP = 2  # steps per side before timing
REAL_WIDTH_CASE = f"{REAL_WIDTH_PRESET} widths L={REAL_WIDTH_LAYERS}"
# tiny-dense widened: embedding and LM head [32000, 512] and MLP matrices [1536, 512] are above C
FSDP_MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "vocab_size": 32000,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
FSDP_MODEL_QUICK = {"num_hidden_layers": 1, "vocab_size": 16384}  # embedding and LM head [16384, 256]: 8 C each
FSDP_BATCH, FSDP_BATCH_QUICK = (1, 64), (1, 16)  # one microbatch per rank per step
FSDP_STEPS = 2


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(self.act(self.up(self.norm2(x))))


class SmallTransformer(nn.Module):
    """A plain decoder-ish module: embedding, pre-norm blocks (attention + MLP), LM head."""

    def __init__(self, vocab: int = 1024, dim: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([_Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _make_step(
    model: nn.Module,
    vocab: int,
    ids: torch.Tensor,
    recorder: Recorder | None,
    opt: torch.optim.Optimizer | None = None,
    *,
    microbatch: int = 0,
    warm_up: bool = True,
) -> Callable[[], None]:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = [0]

    def step() -> None:
        if recorder is not None:
            recorder.start_step(counter[0])
            recorder.set_microbatch(microbatch)
            recorder.record_data(ids)
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        if recorder is not None:
            recorder.record_loss(loss)
        loss.backward()
        if recorder is not None:
            recorder.set_microbatch(-1)
            recorder.record_grads()
        opt.step()
        if recorder is not None:
            recorder.record_optimizer(opt)
            recorder.record_params()
            recorder.end_step()
        opt.zero_grad(set_to_none=True)
        counter[0] += 1

    if warm_up:
        step()  # allocate optimizer state
    return step


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n sides in which each side runs right after each other side equally often
    (a Williams design: n orders for even n, 2n for odd), so that what one side leaves in the
    caches and the allocator weighs on every other side alike."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + r) % n for i in first] for r in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def time_sides(fns: dict[str, Callable[[], None]], options: BenchOptions) -> dict[str, list[float]]:
    """Per-call seconds of each fn in each of `repeats` batches (core's batch sizing), the fns
    interleaved batch by batch in `balanced_orders` (repeat r of every side ran within one
    pass over the sides); the garbage collector is off while timing."""
    names = list(fns)
    orders = balanced_orders(len(names))
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        calls = {name: _calibrate(fns[name], options.min_batch_s) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(options.repeats):
            for i in orders[r % len(orders)]:
                times[names[i]].append(_batch_time(fns[names[i]], calls[names[i]]))
    finally:
        if was_enabled:
            gc.enable()
    return times


def paired_ratio(on: list[float], off: list[float]) -> float:
    """The median over repeats of on's batch time over off's in the same repeat: the machine's
    drift over the run (tens of seconds) cancels in each pair."""
    return statistics.median(a / b for a, b in zip(on, off, strict=True))


def _level_case(label: str, level: str, times: dict[str, list[float]], target: float | None) -> Case:
    off, on = times["off"], times[level]
    case = Case(
        case=f"{label} step, audit {level} vs off",
        baseline="Recorder level off",
        candidate=f"Recorder level {level}",
        baseline_s=statistics.median(off),
        candidate_s=statistics.median(on),
        ratio=statistics.median(on) / statistics.median(off),
        target=target,
    )
    case.extra["ratio_of_minima"] = min(on) / min(off)
    case.extra["paired_ratio"] = paired_ratio(on, off)
    return case


def _model_cases(
    label: str, build: Callable[[], nn.Module], vocab: int, batch: tuple[int, int], options: BenchOptions, tmp: str
) -> list[Case]:
    """One model and one AdamW stepped under a Recorder at each level in turn (two model instances
    differ by a few percent in step time from where their memory landed; one instance does not).
    The `full` Recorder's hooks stay attached, paused while another side steps; `off_again` is a
    second side at `off`: its ratio to `off` is how far two identical sides land apart in the run."""
    ids = torch.randint(0, vocab, batch, generator=torch.Generator().manual_seed(0))
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    levels = {"off": "off", "off_again": "off", "params": "params", "full": "full"}
    recorders = {
        side: Recorder(f"{tmp}/{label}-{side}", model, level=level, flush_every_steps=FLUSH_EVERY)
        for side, level in levels.items()
    }
    full = recorders["full"]

    def side_step(side: str) -> Callable[[], None]:
        step = _make_step(model, vocab, ids, recorders[side], opt)
        if side == "full":
            return step

        def paused_step() -> None:
            with full.paused():
                step()

        return paused_step

    samples = options if options.quick else dataclasses.replace(options, repeats=max(options.repeats, MODEL_REPEATS))
    times = time_sides({side: side_step(side) for side in levels}, samples)
    cases = []
    for level in ("params", "full"):
        case = _level_case(label, level, times, TARGETS[level])
        case.extra["off_again_ratio"] = statistics.median(times["off_again"]) / statistics.median(times["off"])
        case.extra["off_again_paired_ratio"] = paired_ratio(times["off_again"], times["off"])
        case.extra["tokens"] = batch[0] * batch[1]
        cases.append(case)
    for recorder in recorders.values():
        recorder.close()
    return cases


def real_width_config():
    """The real-width case's model: qwen3-0.6b's widths with REAL_WIDTH_LAYERS layers."""
    from titan_audit.models.presets import get_preset

    return dataclasses.replace(get_preset(REAL_WIDTH_PRESET), num_hidden_layers=REAL_WIDTH_LAYERS)


def _real_width_case(options: BenchOptions, tmp: str) -> Case:
    """One model and one optimizer, stepped alternately under a Recorder at `off` and at `params`
    (each step the same work; at ~3 GB of parameters, gradients and AdamW state a second model
    would only cost memory)."""
    from titan_audit.models import build

    config = real_width_config()
    model = build(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, REAL_WIDTH_BATCH, generator=torch.Generator().manual_seed(0))
    steps, recorders = {}, []
    for level in ("off", "params"):
        recorder = Recorder(f"{tmp}/real-width-{level}", model, level=level, flush_every_steps=FLUSH_EVERY)
        recorders.append(recorder)
        steps[level] = _make_step(model, config.vocab_size, ids, recorder, opt)
    for _ in range(REAL_WIDTH_WARMUP):  # the first steps still grow the heap
        for step in steps.values():
            step()
    repeats = BenchOptions(repeats=max(options.repeats, 3), min_batch_s=options.min_batch_s)
    case = _level_case(REAL_WIDTH_CASE, "params", time_sides(steps, repeats), TARGETS["real_width_params"])
    for recorder in recorders:
        recorder.close()
    case.extra["tokens"] = REAL_WIDTH_BATCH[0] * REAL_WIDTH_BATCH[1]
    case.extra["parameters"] = sum(p.numel() for p in model.parameters())
    return case


@dataclass
class BytesCase(Case):
    """A case whose sides are bytes (to_dict: `baseline_bytes`, `candidate_bytes`)."""

    def to_dict(self) -> dict[str, Any]:
        names = {"baseline_s": "baseline_bytes", "candidate_s": "candidate_bytes"}
        return {names.get(k, k): v for k, v in super().to_dict().items()}


def fsdp_config(quick: bool):
    """The FSDP2 case's model: tiny-dense widened (FSDP_MODEL) so that most of its bytes are in
    tensors above C (lattice: each rank hashes its shard); --quick: FSDP_MODEL_QUICK."""
    from titan_audit.models.presets import get_preset

    return dataclasses.replace(get_preset("tiny-dense"), **(FSDP_MODEL_QUICK if quick else FSDP_MODEL))


def fsdp_rank(rank: int, world_size: int, quick: bool, run_dir: str, mode: str = "fsdp") -> dict[str, Any]:
    """One rank of the FSDP2 (or DDP) case (run_local_ranks): the model fully_shard-ed per block
    and at the root over the W ranks (DDP: whole on every rank, the same microbatch on each, so
    the replicas stay equal without a reduction, and a Recorder with split_replicated),
    FSDP_STEPS AdamW steps of one microbatch per rank, a Recorder at level params; per step the
    Recorder's counters (bytes hashed, received), and the calls made to DTensor.full_tensor
    (counted; a record never makes one)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from titan_audit.models import build

    config = fsdp_config(quick)
    model = build(config, seed=0)
    if mode == "fsdp":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    full_tensor_calls = [0]
    full_tensor = DTensor.full_tensor

    def counted(self, *args, **kwargs):
        full_tensor_calls[0] += 1
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = counted
    batch = FSDP_BATCH_QUICK if quick else FSDP_BATCH
    steps = 1 if quick else FSDP_STEPS
    per_step = []
    try:
        recorder = Recorder(
            run_dir, model, level="params", rank=rank, flush_every_steps=steps, split_replicated=mode == "ddp"
        )
        seed = rank if mode == "fsdp" else 0
        ids = torch.randint(0, config.vocab_size, batch, generator=torch.Generator().manual_seed(seed))
        step = _make_step(model, config.vocab_size, ids, recorder, microbatch=rank, warm_up=False)
        for _ in range(steps):
            before = dataclasses.asdict(recorder.counters)
            step()
            after = dataclasses.asdict(recorder.counters)
            per_step.append({k: after[k] - before[k] for k in after})
        recorder.close()
    finally:
        DTensor.full_tensor = full_tensor
    return {"per_step": per_step, "full_tensor_calls": full_tensor_calls[0]}


def _bytes_case(options: BenchOptions, tmp: str, mode: str = "fsdp") -> BytesCase:
    from titan_audit.trainer.local_ranks import run_local_ranks

    runs = {w: run_local_ranks(fsdp_rank, w, args=(options.quick, f"{tmp}/{mode}-w{w}", mode)) for w in (1, 2)}
    per_rank = {w: [r["per_step"][-1] for r in ranks] for w, ranks in runs.items()}  # the last step
    one, two = per_rank[1][0], per_rank[2]
    case = BytesCase(
        case=f"{'FSDP2' if mode == 'fsdp' else 'DDP'} W=2 vs W=1, audit params: bytes hashed per rank per step",
        baseline="W=1 (one rank hashes every record)",
        candidate="W=2 (max over the ranks)",
        baseline_s=one["hashed_bytes"],
        candidate_s=max(r["hashed_bytes"] for r in two),
        ratio=max(r["hashed_bytes"] for r in two) / one["hashed_bytes"],
        target=TARGETS["fsdp_hashed"],
    )
    writer = two[0]  # rank 0 writes the step-level records: it receives the others' lanes and pieces
    case.extra.update(
        {
            "hashed_bytes_per_rank_w1": [r["hashed_bytes"] for r in per_rank[1]],
            "hashed_bytes_per_rank_w2": [r["hashed_bytes"] for r in two],
            "received_bytes_per_rank_w1": [r["received_bytes"] for r in per_rank[1]],
            "received_bytes_per_rank_w2": [r["received_bytes"] for r in two],
            "lattice_records_w2": writer["lattice_records"],
            "received_bytes_per_lattice_record_w2": writer["lattice_received_bytes"]
            / max(writer["lattice_records"], 1),
            "gathered_records_w2": writer["gathered_records"],
            "received_bytes_per_gathered_record_w2": writer["gathered_received_bytes"]
            / max(writer["gathered_records"], 1),
            "full_tensor_calls": sum(r["full_tensor_calls"] for ranks in runs.values() for r in ranks),
            "model": {k: getattr(fsdp_config(options.quick), k) for k in FSDP_MODEL},
            "whole_hash_bytes": whole_hash_bytes(),
            "threads": 1,  # per rank (run_local_ranks); the case counts bytes, it times nothing
        }
    )
    return case


def all_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def audit_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    threads = torch.get_num_threads()
    run_threads = options.threads or all_cores()
    torch.set_num_threads(run_threads)
    try:
        cases = _cases(options, progress)
    finally:
        torch.set_num_threads(threads)
    for case in cases:
        case.extra.setdefault("threads", run_threads)
    return cases


INTERVAL = 20  # steps between checkpoints (and audit flushes) of a generated log
CRASH_AFTER = 25  # steps after its last checkpoint at which the generated run was killed


def records_table(first: int, steps: int, per_step: int) -> pa.Table:
    """`per_step` param records for each step first..first+steps-1, hashes xxh3 of (step, name)."""
    names = [f"layers.{i // 4}.w{i % 4}" for i in range(per_step)]
    rows = steps * per_step
    hashes = [xxhash.xxh3_128_hexdigest(f"{s}:{n}".encode()) for s in range(first, first + steps) for n in names]
    columns = {
        "step": np.repeat(np.arange(first, first + steps, dtype=np.int64), per_step),
        "phase": pa.array(["param"] * rows),
        "microbatch": np.full(rows, -1, dtype=np.int32),
        "name": pa.array(names * steps),
        "dtype": pa.array(["float32"] * rows),
        "shape": pa.array(["[64, 64]"] * rows),
        "hash": pa.array(hashes),
        "absmax": pa.nulls(rows, pa.float64()),
        "mean": pa.nulls(rows, pa.float64()),
        "rank": np.zeros(rows, dtype=np.int32),
        "seq": np.tile(np.arange(per_step, dtype=np.int64), steps),
    }
    return pa.table(columns, schema=SCHEMA)


def generated_log(run_dir: str | Path, checkpoint: int, *, per_step: int = 12) -> int:
    """Rank 0's audit log of a run killed CRASH_AFTER steps after its checkpoint at step
    `checkpoint` (a multiple of INTERVAL), with a checkpoint and a flush every INTERVAL steps: the
    parts up to the one before that checkpoint's are generated (encode_part, the writer's bytes,
    written without fsync and indexed at once: a long log in seconds), the checkpoint's part and
    the one flushed after it are written by the recorder's own writer. Returns `checkpoint`, the
    step a resume starts from."""
    assert checkpoint >= INTERVAL and checkpoint % INTERVAL == 0, checkpoint
    directory = audit_dir(run_dir)
    directory.mkdir(parents=True)
    entries: list[PartEntry] = []
    for part, first in enumerate(range(1, checkpoint - INTERVAL + 1, INTERVAL)):
        data, entry = encode_part(records_table(first, INTERVAL, per_step), part)
        (directory / part_name(0, part)).write_bytes(data)
        entries.append(entry)
    ensure_index(directory, {0: entries})
    writer = AuditLogWriter(run_dir)
    for first in range(checkpoint - INTERVAL + 1, checkpoint + CRASH_AFTER - INTERVAL + 1, INTERVAL):
        writer.write(records_table(first, INTERVAL, per_step).to_pydict())
    return checkpoint


def _resume_case(options: BenchOptions, tmp: str) -> Case:
    long_steps = 10**4 if options.quick else 10**5
    short = generated_log(f"{tmp}/log-20", 20)
    long = generated_log(f"{tmp}/log-{long_steps}", long_steps)
    checks = {}

    def check(run: str, step: int) -> Callable[[], None]:
        def run_check() -> None:
            checks[run] = check_audit_log(run, after_step=step, mark=False)

        return run_check

    case = compare(
        f"resume check of the audit log, {long_steps} steps vs 20",
        ("20-step log", check(f"{tmp}/log-20", short)),
        (f"{long_steps}-step log", check(f"{tmp}/log-{long_steps}", long)),
        options,
        target=TARGETS["resume"],
    )
    start = time.perf_counter()
    verified = verify_log(f"{tmp}/log-{long_steps}")
    case.extra["verify_all_s"] = time.perf_counter() - start
    assert verified.ok, verified.problems
    for label, run in (("short", f"{tmp}/log-20"), ("long", f"{tmp}/log-{long_steps}")):
        case.extra[f"{label}_parts_read"] = checks[run].parts_verified
        case.extra[f"{label}_bytes_read"] = checks[run].bytes_read + checks[run].index_bytes_read
    case.extra["long_parts"] = verified.parts
    return case


def _cases(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    cases = []
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-") as tmp:
        small_batch = (2, 32) if options.quick else (8, 128)
        cases += _model_cases("small-transformer", SmallTransformer, 1024, small_batch, options, tmp)
        progress("small-transformer")
        if not options.quick:
            from titan_audit.models import build

            preset = "tiny-dense"
            vocab = build(preset).config.vocab_size
            cases += _model_cases(preset, lambda: build(preset, seed=0), vocab, (4, 128), options, tmp)
            progress(preset)
            cases.append(_real_width_case(options, tmp))
            progress(REAL_WIDTH_CASE)
        cases.append(_bytes_case(options, tmp, "fsdp"))
        progress("FSDP2 W=2")
        cases.append(_bytes_case(options, tmp, "ddp"))
        progress("DDP W=2")
        cases.append(_resume_case(options, tmp))
        progress("resume check")
    return cases
