"""Test helper: a tiny plain nn.Module trained for a few steps under a Recorder, with optional
perturbations (one ULP in one tensor, or another data batch) injected at a chosen place."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_audit.audit import Recorder
from titan_audit.audit.bitwise import bits

VOCAB, DIM, SEQ, BATCH = 32, 16, 6, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MODULE_NAMES = [
    "<root>",
    "embed",
    "blocks.0",
    "blocks.0.norm",
    "blocks.0.fc1",
    "blocks.0.act",
    "blocks.0.fc2",
    "blocks.1",
    "blocks.1.norm",
    "blocks.1.fc1",
    "blocks.1.act",
    "blocks.1.fc2",
    "head",
]
PARAM_NAMES = [name for name, _ in Tiny().named_parameters()]


@dataclass(frozen=True)
class Perturb:
    kind: str  # forward | grad | optim | data
    step: int
    target: str = ""  # module name (forward), parameter name (grad, optim)
    microbatch: int = 0


def one_ulp(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with the lowest bit of element 0 flipped: one ULP away, bitwise different."""
    out = t.detach().clone()
    flat = bits(out).reshape(-1)
    flat[0] ^= 1
    return flat.view(out.dtype).reshape(out.shape)


def batch(step: int, microbatch: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + microbatch + 7919 * salt)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def microbatch_loss(model: nn.Module, ids: torch.Tensor, microbatches: int) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) / microbatches


def train(
    run_dir,
    *,
    steps: int = 3,
    microbatches: int = 2,
    level: str = "full",
    perturb: Perturb | None = None,
    dump_names=(),
    modules=("*",),
    flush_every_steps: int = 1,
) -> None:
    """Train Tiny for `steps` steps of `microbatches` microbatches, recording into run_dir."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"step": -1, "mb": -1}
    if perturb is not None and perturb.kind == "forward":
        target = model if perturb.target == "<root>" else model.get_submodule(perturb.target)

        def hook(_m, _i, out):
            if state["step"] == perturb.step and state["mb"] == perturb.microbatch:
                mask = torch.zeros(out.shape, dtype=torch.bool)
                mask.view(-1)[0] = True
                return torch.where(mask, one_ulp(out), out)  # exact bits; gradient still flows
            return None

        # registered before the Recorder's hooks, so the recorder sees the perturbed output
        target.register_forward_hook(hook)
    recorder = Recorder(
        run_dir, model, level=level, dump_names=dump_names, modules=modules, flush_every_steps=flush_every_steps
    )
    params = dict(model.named_parameters())
    for step in range(steps):
        state["step"] = step
        recorder.start_step(step)
        for mb in range(microbatches):
            state["mb"] = mb
            recorder.set_microbatch(mb)
            salt = (
                1
                if perturb is not None and perturb.kind == "data" and (step, mb) == (perturb.step, perturb.microbatch)
                else 0
            )
            ids = batch(step, mb, salt)
            recorder.record_data(ids)
            loss = microbatch_loss(model, ids, microbatches)
            recorder.record_loss(loss)
            loss.backward()
        recorder.set_microbatch(-1)
        if perturb is not None and perturb.kind == "grad" and step == perturb.step:
            p = params[perturb.target]
            p.grad = one_ulp(p.grad)
        recorder.record_grads()
        opt.step()
        if perturb is not None and perturb.kind == "optim" and step == perturb.step:
            st = opt.state[params[perturb.target]]
            st["exp_avg"].copy_(one_ulp(st["exp_avg"]))
        recorder.record_optimizer(opt)
        recorder.record_params()
        opt.zero_grad(set_to_none=True)
        recorder.end_step()
    recorder.close()
