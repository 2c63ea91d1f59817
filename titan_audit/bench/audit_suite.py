"""`bench audit`: training-step time with the audit Recorder at `params` and `full` against `off`.

One step = forward + backward + AdamW step on one microbatch, with the Recorder calls a trainer
makes (start_step, set_microbatch, record_data, record_loss, record_grads, record_optimizer,
record_params, end_step flushing a Parquet part every FLUSH_EVERY steps). Baseline: the same
step with a Recorder at level `off` (it installs no hook and records nothing); the plain step
without any Recorder is reported as the extra key `plain_s`. Models: a small transformer-ish
plain `nn.Module` defined here (the Recorder assumes nothing about the model) and, unless
--quick, the `tiny-dense` preset of titan_audit.models. Targets (issue 5): params <= 1.03x,
full <= 1.10x. Records go to a temporary run directory deleted afterwards.

The suite runs with one intra-op thread (restored afterwards; reported as the extra key
`threads`): on a shared 2-core machine a second thread makes every parallel kernel's time depend
on what the neighbours run, which swamps a few-percent ratio. The recorder's hashing is
single-threaded, so with more threads the same ratios would be somewhat higher.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import torch
from torch import nn

from titan_audit.audit import Recorder
from titan_audit.bench.core import BenchOptions, Case, compare

TARGETS = {"params": 1.03, "full": 1.10}
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
    return cases
