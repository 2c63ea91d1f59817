"""`bench ops`: the batch-invariant ops against their native torch counterparts, float32.

Cases: `linear` (F.linear vs bi.linear, no bias) and `matmul` (x @ w vs bi.matmul) over
M in {1, 2, 4, 8, 16, 64, 256, 1024} and LLM-like (K, N); attention prefill (causal, Tq == Tk)
and decode (Tq == 1 from a KV cache) against `F.scaled_dot_product_attention`; the row ops
(softmax, log_softmax, rms_norm) at LLM widths. Each case is named `<op> <shape>`, e.g.
`linear M=64 K=1024 N=4096`. Float32 is the CPU compute dtype (bf16 gemm is much slower on CPUs
without AMX; bf16 is covered by the correctness tests, not timed here). The same weight is used
in every repetition, so bi.linear runs from its packed-weight cache (a decode step's situation;
a training step repacks each weight once per step).

Targets (issue 14, our own kernels; ratios are same-run times, ours / native):
- gemm: two aggregate cases, `matmul+linear geomean M>=16` <= 1.1x and `matmul+linear geomean
  M<=4` <= 1.25x, whose times are the geometric means of their group's times (so their ratio is
  the group's geometric-mean ratio; `"aggregate": true`). Single gemm cases carry no target
  (M = 8 is in neither group).
- attention: `attention geomean` (every prefill and decode case) <= 1.3x, and each decode step
  of plain multi-head attention (Hq == Hkv: one query row per KV head) <= 2x.
- softmax, log_softmax and rms_norm: each case <= 1.5x.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from titan_audit import batch_invariant as bi
from titan_audit.bench.core import BenchOptions, Case, compare

MS = [1, 2, 4, 8, 16, 64, 256, 1024]
KN = [(1024, 1024), (1024, 4096), (4096, 1024)]
QUICK_MS = [1, 4, 16]
QUICK_KN = [(256, 256)]
TARGET_GEOMEAN_MATMUL_LARGE_M = 1.1  # M >= 16
TARGET_GEOMEAN_MATMUL_SMALL_M = 1.25  # M <= 4
TARGET_ATTENTION_GEOMEAN = 1.3
TARGET_DECODE_MHA = 2.0
TARGET_ROW_OPS = 1.5

# (batch, q heads, kv heads, tokens, head dim)
PREFILL = [(1, 16, 16, 512, 64), (1, 16, 4, 2048, 64)]
DECODE = [(8, 16, 16, 512, 64), (8, 16, 4, 2048, 64), (32, 16, 4, 1024, 64)]
QUICK_PREFILL = [(1, 4, 2, 128, 32)]
QUICK_DECODE = [(2, 4, 2, 128, 32), (2, 4, 4, 128, 32)]
ROWS = [(64, 4096), (16, 32768)]
QUICK_ROWS = [(8, 512)]


def _aggregate(name: str, cases: list[Case], target: float) -> Case:
    base = math.exp(sum(math.log(c.baseline_s) for c in cases) / len(cases))
    cand = math.exp(sum(math.log(c.candidate_s) for c in cases) / len(cases))
    return Case(name, "geomean of group baselines", "geomean of group candidates", base, cand, cand / base, target,
                extra={"aggregate": True, "cases_in_group": len(cases)})


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], object]:
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def ops_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    big_m: list[Case] = []
    small_m: list[Case] = []
    for k, n in QUICK_KN if options.quick else KN:
        w = torch.randn(n, k, generator=g)
        wt = w.t().contiguous()
        for m in QUICK_MS if options.quick else MS:
            x = torch.randn(m, k, generator=g)
            for op, base, cand in (
                ("linear", ("F.linear", lambda: F.linear(x, w)), ("bi.linear", lambda: bi.linear(x, w))),
                ("matmul", ("torch.matmul", lambda: x @ wt), ("bi.matmul", lambda: bi.matmul(x, wt))),
            ):
                name = f"{op} M={m} K={k} N={n}"
                case = compare(name, base, cand, options, target=None)
                case.extra["gflops"] = 2 * m * k * n / case.candidate_s / 1e9
                cases.append(case)
                (big_m if m >= 16 else small_m if m <= 4 else []).append(case)
                progress(name)
    attention: list[Case] = []
    for kind, shapes in (("prefill", QUICK_PREFILL if options.quick else PREFILL),
                         ("decode", QUICK_DECODE if options.quick else DECODE)):
        for b, hq, hkv, t, d in shapes:
            tq = t if kind == "prefill" else 1
            q = torch.randn(b, hq, tq, d, generator=g)
            kk = torch.randn(b, hkv, t, d, generator=g)
            vv = torch.randn(b, hkv, t, d, generator=g)
            causal = kind == "prefill"  # decode: the one query sees the whole cache
            rows = tq * hq // hkv  # query rows per KV head
            name = f"attention {kind} B={b} Hq={hq} Hkv={hkv} Tq={tq} Tk={t} D={d}"
            decode_mha = kind == "decode" and hq == hkv
            case = compare(name, ("F.scaled_dot_product_attention", _sdpa(q, kk, vv, causal)),
                           ("bi.attention", lambda q=q, kk=kk, vv=vv: bi.attention(q, kk, vv)), options,
                           target=TARGET_DECODE_MHA if decode_mha else None)
            case.extra["rows_per_kv_head"] = rows
            cases.append(case)
            attention.append(case)
            progress(name)
    for m, n in QUICK_ROWS if options.quick else ROWS:
        x = torch.randn(m, n, generator=g)
        w = torch.randn(n, generator=g)
        for op, base, cand in (
            ("softmax", lambda: torch.softmax(x, -1), lambda: bi.softmax(x)),
            ("log_softmax", lambda: torch.log_softmax(x, -1), lambda: bi.log_softmax(x)),
            ("rms_norm", lambda: F.rms_norm(x, (n,), w, 1e-6), lambda: bi.rms_norm(x, w, 1e-6)),
        ):
            name = f"{op} M={m} N={n}"
            cases.append(compare(name, (f"torch {op}", base), (f"bi.{op}", cand), options, target=TARGET_ROW_OPS))
            progress(name)
    cases.append(_aggregate("matmul+linear geomean M>=16", big_m, TARGET_GEOMEAN_MATMUL_LARGE_M))
    cases.append(_aggregate("matmul+linear geomean M<=4", small_m, TARGET_GEOMEAN_MATMUL_SMALL_M))
    cases.append(_aggregate("attention geomean", attention, TARGET_ATTENTION_GEOMEAN))
    return cases
