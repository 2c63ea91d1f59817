"""`titan-audit demo`: the project's main job, end to end on a CPU in seconds.

What it shows today (later issues extend it to train -> audit -> elastic replay -> RL -> golden):
1. the numerics fingerprint of this machine (what decides the bits);
2. G1 run-to-run: a small model trained twice under `deterministic.enable(seed)` gets identical
   parameter fingerprints after every step;
3. a negative control: the same training with another seed differs from step 0, so the check
   above can fail;
4. G2 batch invariance on the `tiny-dense` decoder: token-by-token decode from a KV cache gives
   the same logits bits as one full forward in batch-invariant mode, and different bits with the
   native ops (the negative control that shows the check can fail).
It returns False (and the CLI exits 1) if any expectation fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from titan_audit import batch_invariant, models
from titan_audit.audit import bitwise_equal, fingerprint, fingerprint_many
from titan_audit.deterministic import enable, torch_generator
from titan_audit.deterministic import fingerprint as numerics_fingerprint

VOCAB, DIM, SEQ, BATCH, STEPS = 256, 64, 32, 8, 5


@dataclass
class TrainTrace:
    seed: int
    param_hashes: list[str]  # one digest of all parameter fingerprints per step
    losses: list[float]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
        torch.nn.Linear(DIM, 4 * DIM),
        torch.nn.GELU(),
        torch.nn.Linear(4 * DIM, VOCAB),
    )


def _state_digest(model: torch.nn.Module) -> str:
    """One fingerprint standing for every parameter: the hash of their hashes, in name order."""
    hashes = fingerprint_many(dict(model.named_parameters()))
    joined = "".join(hashes[name] for name in sorted(hashes))
    return fingerprint(torch.frombuffer(bytearray(joined.encode()), dtype=torch.uint8))


def train_tiny(seed: int, steps: int = STEPS) -> TrainTrace:
    """Train the demo model for `steps` steps in deterministic mode; data from keyed streams."""
    trace = TrainTrace(seed=seed, param_hashes=[], losses=[])
    with enable(seed):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(steps):
            tokens = torch.stack([
                torch.randint(VOCAB, (SEQ + 1,), generator=torch_generator(seed, "demo.data", step, i))
                for i in range(BATCH)
            ])  # fmt: skip
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trace.param_hashes.append(_state_digest(model))
            trace.losses.append(loss.item())
    return trace


@torch.no_grad()
def decode_matches_full_forward(bi: bool, prompt_len: int = 24, new_tokens: int = 8) -> bool:
    """Do cached token-by-token decode logits equal one full forward's, bit for bit?"""
    model = models.build("tiny-dense", seed=0)
    tokens = torch.randint(model.config.vocab_size, (1, prompt_len + new_tokens),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    with batch_invariant.enabled(bi):
        full = model(tokens)
        cache = models.ContiguousKVCache(model.config, batch_size=1, max_len=prompt_len + new_tokens)
        steps = [model(tokens[:, :prompt_len], cache=cache)]
        for t in range(prompt_len, prompt_len + new_tokens):
            steps.append(model(tokens[:, t : t + 1], cache=cache))
    return bitwise_equal(torch.cat(steps, dim=1), full)


def run(console: Console | None = None) -> bool:
    console = console or Console()
    ok = True
    fp = numerics_fingerprint()
    console.rule("[bold]titan-audit demo")
    console.print(
        f"numerics: torch {fp.torch_version} on {fp.device_kind} ({fp.device_name}), "
        f"ISA {fp.cpu_capability}, BLAS {fp.blas}, threads {fp.num_threads}"
    )

    console.rule("G1 run-to-run: two runs, same seed")
    run_a, run_b, other = train_tiny(0), train_tiny(0), train_tiny(1)
    table = Table("step", "loss", "run A params", "run B params", "seed 1 (control)")
    for step in range(STEPS):
        same = run_a.param_hashes[step] == run_b.param_hashes[step]
        control_same = run_a.param_hashes[step] == other.param_hashes[step]
        table.add_row(
            str(step),
            f"{run_a.losses[step]:.4f}",
            run_a.param_hashes[step][:16],
            ("[green]" if same else "[red]") + run_b.param_hashes[step][:16],
            ("[red]" if control_same else "[yellow]") + other.param_hashes[step][:16],
        )
        ok &= same and not control_same
    console.print(table)
    console.print(
        "[green]identical bits in both runs at every step[/]"
        if run_a.param_hashes == run_b.param_hashes
        else "[red]runs A and B differ: determinism is broken on this machine[/]"
    )

    console.rule("G2 batch invariance: KV-cache decode vs full forward (tiny-dense)")
    bi_equal, native_equal = decode_matches_full_forward(bi=True), decode_matches_full_forward(bi=False)
    console.print(
        f"batch-invariant ops: {'[green]identical bits' if bi_equal else '[red]DIFFERENT bits'}[/]; "
        f"native ops (control): {'identical bits' if native_equal else '[yellow]different bits[/]'}"
    )
    ok &= bi_equal
    console.rule("[green]demo passed" if ok else "[red]demo found a problem")
    return ok
