"""`bench ops`: the batch-invariant ops against their native torch counterparts, float32.

Cases: `linear` (F.linear vs bi.linear, no bias) and `matmul` (x @ w vs bi.matmul) over
M in {1, 2, 4, 8, 16, 64, 256, 1024} and LLM-like (K, N); attention prefill (causal, Tq == Tk)
and decode (Tq == 1 from a KV cache) against `F.scaled_dot_product_attention`; the row ops
(softmax, log_softmax, rms_norm) at LLM widths, reported without a target. Each case is named
`<op> <shape>`, e.g. `linear M=64 K=1024 N=4096`. Float32 is the CPU compute dtype (bf16 gemm is
much slower on CPUs without AMX; bf16 is covered by the correctness tests, not timed here).

Targets (this CPU, from issue 3): a case with M >= 4 rows <= 2x and with M < 4 <= 4x; and two
aggregate cases, `matmul+linear geomean M>=4` <= 1.15x and `attention geomean` <= 1.5x, whose
times are the geometric means of their group's times (so their ratio is the group's
geometric-mean ratio; `"aggregate": true`). For attention, M is the gemm row count: the query
rows that share one KV head's keys, Tq * Hq / Hkv. A decode step of plain multi-head attention
has M = 1 (one query row per head; the kernel pads it to 4 rows, as matmul pads M = 1), so it
gets the small-M bound; GQA decode with 4 query heads per KV head has M = 4.
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
TARGET_SMALL_M = 4.0
TARGET_CASE = 2.0
TARGET_GEOMEAN_MATMUL = 1.15
TARGET_GEOMEAN_ATTENTION = 1.5

# (batch, q heads, kv heads, tokens, head dim)
PREFILL = [(1, 16, 16, 512, 64), (1, 16, 4, 2048, 64)]
DECODE = [(8, 16, 16, 512, 64), (8, 16, 4, 2048, 64), (32, 16, 4, 1024, 64)]
QUICK_PREFILL = [(1, 4, 2, 128, 32)]
QUICK_DECODE = [(2, 4, 2, 128, 32)]
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
    for k, n in QUICK_KN if options.quick else KN:
        w = torch.randn(n, k, generator=g)
        wt = w.t().contiguous()
        for m in QUICK_MS if options.quick else MS:
            x = torch.randn(m, k, generator=g)
            target = TARGET_CASE if m >= 4 else TARGET_SMALL_M
            for op, base, cand in (
                ("linear", ("F.linear", lambda: F.linear(x, w)), ("bi.linear", lambda: bi.linear(x, w))),
                ("matmul", ("torch.matmul", lambda: x @ wt), ("bi.matmul", lambda: bi.matmul(x, wt))),
            ):
                name = f"{op} M={m} K={k} N={n}"
                case = compare(name, base, cand, options, target=target)
                case.extra["gflops"] = 2 * m * k * n / case.candidate_s / 1e9
                cases.append(case)
                (big_m if m >= 4 else []).append(case)
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
            rows = tq * hq // hkv  # gemm rows per KV head (see the module doc)
            name = f"attention {kind} B={b} Hq={hq} Hkv={hkv} Tq={tq} Tk={t} D={d}"
            case = compare(name, ("F.scaled_dot_product_attention", _sdpa(q, kk, vv, causal)),
                           ("bi.attention", lambda q=q, kk=kk, vv=vv: bi.attention(q, kk, vv)), options,
                           target=TARGET_CASE if rows >= 4 else TARGET_SMALL_M)
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
            cases.append(compare(name, (f"torch {op}", base), (f"bi.{op}", cand), options, target=None))
            progress(name)
    cases.append(_aggregate("matmul+linear geomean M>=4", big_m, TARGET_GEOMEAN_MATMUL))
    cases.append(_aggregate("attention geomean", attention, TARGET_GEOMEAN_ATTENTION))
    return cases
