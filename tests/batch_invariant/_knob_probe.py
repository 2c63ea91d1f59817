"""Run in a subprocess by test_knobs.py: hash BI results under the environment it was started
with (TITAN_AUDIT_CPU_ISA, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR are read at process
start). Prints one JSON object: name -> audit fingerprint, the ISA and capability the process
runs, plus "native" hashes of torch ops that may depend on the knobs (reported by the tests, never
asserted: what a native library does under a knob depends on the CPU). `--gemm-order v1` computes
the BI results in gemm order v1 (the negative control: another order the comparison must see).

Inputs come from numpy's Philox (integer arithmetic), never from torch's RNG, whose normal
sampler itself depends on ATEN_CPU_CAPABILITY.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import fingerprint
from titan_audit.batch_invariant.cpu import _lib


def _data(seed: int, *shape: int) -> torch.Tensor:
    g = np.random.Generator(np.random.Philox(seed))
    return torch.from_numpy(g.standard_normal(shape, dtype=np.float32))


def bi_results() -> dict[str, str]:
    out: dict[str, str] = {}
    torch.set_num_threads(2)
    x, w = _data(1, 37, 200), _data(2, 96, 200)
    q, k, v = _data(3, 2, 4, 9, 128), _data(4, 2, 2, 9, 128), _data(5, 2, 2, 9, 128)
    rows = _data(6, 13, 1000)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out["linear"] = fingerprint(bi.linear(x, w))
    out["linear_bf16"] = fingerprint(bi.linear(x.bfloat16(), w.bfloat16()))
    out["bmm"] = fingerprint(bi.bmm(_data(7, 3, 17, 64), _data(8, 3, 64, 33)))
    att = bi.attention(q, k, v)
    att.backward(_data(9, *att.shape))
    out["attention"] = fingerprint(att.detach())
    out["attention_grads"] = fingerprint(torch.cat([q.grad.flatten(), k.grad.flatten(), v.grad.flatten()]))
    out["softmax"] = fingerprint(bi.softmax(rows))
    out["log_softmax"] = fingerprint(bi.log_softmax(rows))
    out["rms_norm"] = fingerprint(bi.rms_norm(rows, _data(10, 1000)))
    out["sum"] = fingerprint(bi.sum(rows))
    from titan_audit.models.rope import RotaryTable

    out["rope_table_qwen3"] = fingerprint(torch.cat(RotaryTable(128, 1e6, 40960)._build()))
    model = models.build("tiny-dense", seed=0)
    out["init"] = fingerprint(torch.cat([p.detach().flatten() for p in model.parameters()]))
    tokens = torch.from_numpy(np.random.Generator(np.random.Philox(11)).integers(0, 2048, (2, 12)))
    with bi.enabled(), torch.no_grad():
        out["forward"] = fingerprint(model(tokens))
        cache = models.PagedKVCache(model.config, num_blocks=8, block_size=4)
        cache.add("a")
        logits = [model(tokens[:1, :5], cache=cache.batch(["a"]))[0, -1]]
        for t in range(5, 12):
            logits.append(model(tokens[:1, t : t + 1], cache=cache.batch(["a"]))[0, -1])
        out["decode"] = fingerprint(torch.stack(logits))
    return out


def native_results() -> dict[str, str]:
    rows = _data(6, 13, 1000)
    p = torch.nn.Parameter(_data(12, 10_001))
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False, fused=False)
    p.grad = _data(13, 10_001)
    opt.step()
    angles = torch.outer(torch.arange(40960).float(), _data(14, 64).abs())
    roots = _data(15, 100_003).abs()
    correctly_rounded = roots.double().sqrt().float()  # float64 sqrt rounded once: the correctly rounded float32 root
    return {
        "native_sqrt_not_correctly_rounded": int(
            (roots.sqrt().view(torch.int32) != correctly_rounded.view(torch.int32)).sum()
        ),
        "native_sum": fingerprint(rows.sum(-1)),
        "native_adamw": fingerprint(p.detach()),
        "native_cos": fingerprint(angles.cos()),
        "native_sqrt": fingerprint(_data(15, 100_003).abs().sqrt()),
        "native_normal": fingerprint(torch.empty(4096).normal_(generator=torch.Generator().manual_seed(0))),
    }


if __name__ == "__main__":
    order = sys.argv[sys.argv.index("--gemm-order") + 1] if "--gemm-order" in sys.argv else "v2"
    with bi.gemm_order(order):
        results = bi_results()
    json.dump(
        {
            "isa": _lib.isa(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "bi": results,
            "native": native_results(),
        },
        sys.stdout,
    )
