"""`bench audit`: training-step time with the audit Recorder at `params` and `full` against `off`.

One step = forward + backward + AdamW step on one microbatch, with the Recorder calls a trainer
makes (start_step, set_microbatch, record_data, record_loss, record_grads, record_optimizer,
record_params, end_step flushing a Parquet part every FLUSH_EVERY steps). Baseline: the same
step with a Recorder at level `off` (it installs no hook and records nothing); the plain step
without any Recorder is reported as the extra key `plain_s`. Models: a small transformer-ish
plain `nn.Module` defined here (the Recorder assumes nothing about the model) and, unless
--quick, the `tiny-dense` preset of titan_audit.models. Targets (issue 5): params <= 1.03x,
full <= 1.10x. Records go to a temporary run directory deleted afterwards.

Case `resume check`: the check a resume makes of the audit log before it appends
(audit.log.check_audit_log, read-only here so each call reads the same parts) on the log of a
run killed 25 steps after its checkpoint at step N (`generated_log`: a checkpoint and flush every
20 steps, 12 param records per step), N = 10^5 (10^4 with --quick) against N = 20. Target 1.2:
its cost does not grow with the run's length. Extra keys: the parts of the long log, the parts
and bytes each check reads, and `verify_all_s`, one full read of the long log (`titan-audit
verify`, what every resume paid before the index).

The suite runs with one intra-op thread (restored afterwards; reported as the extra key
`threads`): on a shared 2-core machine a second thread makes every parallel kernel's time depend
on what the neighbours run, which swamps a few-percent ratio. The recorder's hashing is
single-threaded, so with more threads the same ratios would be somewhat higher.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import xxhash
from torch import nn

from titan_audit.audit import Recorder
from titan_audit.audit.log import AuditLogWriter, audit_dir, check_audit_log, encode_part, verify_log
from titan_audit.audit.log_index import PartEntry, ensure_index, part_name
from titan_audit.audit.schema import SCHEMA
from titan_audit.bench.core import BenchOptions, Case, compare

TARGETS = {"params": 1.03, "full": 1.10, "resume": 1.2}
FLUSH_EVERY = 10
THREADS = 1


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


def _make_step(model: nn.Module, vocab: int, ids: torch.Tensor, recorder: Recorder | None) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = [0]

    def step() -> None:
        if recorder is not None:
            recorder.start_step(counter[0])
            recorder.set_microbatch(0)
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

    step()  # warm up: allocate optimizer state
    return step


def _model_cases(
    label: str, build: Callable[[], nn.Module], vocab: int, batch: tuple[int, int], options: BenchOptions, tmp: str
) -> list[Case]:
    ids = torch.randint(0, vocab, batch, generator=torch.Generator().manual_seed(0))
    steps: dict[str, Callable[[], None]] = {"plain": _make_step(build(), vocab, ids, None)}
    recorders = []
    for level in ("off", "params", "full"):
        model = build()
        recorder = Recorder(f"{tmp}/{label}-{level}", model, level=level, flush_every_steps=FLUSH_EVERY)
        recorders.append(recorder)
        steps[level] = _make_step(model, vocab, ids, recorder)
    cases = []
    for level in ("params", "full"):
        case = compare(
            f"{label} step, audit {level} vs off",
            ("Recorder level off", steps["off"]),
            (f"Recorder level {level}", steps[level]),
            options,
            target=TARGETS[level],
            others={"plain": steps["plain"]},
        )
        case.extra["tokens"] = batch[0] * batch[1]
        cases.append(case)
    for recorder in recorders:
        recorder.close()
    return cases


def audit_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        cases = _cases(options, progress)
    finally:
        torch.set_num_threads(threads)
    for case in cases:
        case.extra["threads"] = THREADS
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
        cases.append(_resume_case(options, tmp))
        progress("resume check")
    return cases
