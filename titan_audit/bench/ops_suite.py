"""`bench ops`: the batch-invariant ops against their native torch counterparts, float32.

Cases: `linear` (F.linear vs bi.linear, no bias) and `matmul` (x @ w vs bi.matmul) over
M in {1, 2, 4, 8, 16, 64, 256, 1024} and LLM-like (K, N); attention prefill (causal, Tq == Tk)
and decode (Tq == 1 from a KV cache) against `F.scaled_dot_product_attention`; the row ops
(softmax, log_softmax, rms_norm) at LLM widths. Each case is named `<op> <shape>`, e.g.
`linear M=64 K=1024 N=4096`. Float32 is the CPU compute dtype. The bfloat16 cases (`linear bf16
...`, no target) say what bf16 costs: our kernel widens bf16 to float32 and sums in the fixed
order, where MKL/oneDNN on a CPU with AMX (Sapphire Rapids and later) multiply bf16 on AMX tiles,
an order no portable fixed-order kernel matches. The same weight is used in every repetition, so
bi.linear runs from its packed-weight cache (a decode step's situation; a training step repacks
each weight once per step).

Targets (our own kernels; ratios are same-run times, ours / native):
- gemm: two aggregate cases, `matmul+linear geomean M>=16` <= 1.1x and `matmul+linear geomean
  M<=4` <= 1.25x, whose times are the geometric means of their group's times (so their ratio is
  the group's geometric-mean ratio; `"aggregate": true`). Single gemm cases carry no target
  (M = 8 is in neither group).
- gemm summation orders: every gemm case also times the CPU kernel (`cpu.matmul.mm`, same B
  layout) in order v1 (`blocks=1`) and v2 (`blocks=tree_blocks(K)`), interleaved with the two sides
  (`v1_s`, `v2_s` in the case's extra). From those times, per shape: `<op> v2 <shape>` (v2 against
  the native side) and `<op> v2/v1 <shape>` (v2 against v1), no targets; aggregates `matmul+linear
  v2 geomean M>=16` <= 1.1x, `matmul+linear v2 geomean M<=4` <= 1.25x and `gemm v2/v1 geomean`
  (every shape) <= 1.05x.
- attention: `attention geomean` (every prefill and decode case) <= 1.3x, and each decode step
  of plain multi-head attention (Hq == Hkv: one query row per KV head) <= 2x.
- softmax, log_softmax and rms_norm: each case <= 1.5x.

On a machine with CUDA the suite adds CUDA cases (named `cuda ...`), the Triton backend against
cuBLAS / SDPA in the same run, timed by `triton.testing.do_bench` (CUDA events, median): bf16
matmul over M in {1, 64, 256, 1024, 4096} (target for M >= 256: >= 0.8x cuBLAS throughput, i.e.
ratio <= 1.25), float32 matmul (no TF32 on either side), bf16 decode attention against
F.scaled_dot_product_attention (target >= 0.7x, ratio <= 1 / 0.7), a bf16 causal prefill, and the
bf16 row ops (no targets). Each CUDA case records the GPU name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from titan_audit import batch_invariant as bi
from titan_audit.batch_invariant.cpu import matmul as cpu_matmul
from titan_audit.bench.core import BenchOptions, Case, compare

MS = [1, 2, 4, 8, 16, 64, 256, 1024]
KN = [(1024, 1024), (1024, 4096), (4096, 1024)]
QUICK_MS = [1, 4, 16]
QUICK_KN = [(256, 256)]
BF16_MS = [1, 16, 256]  # at BF16_KN
BF16_KN = (1024, 1024)
QUICK_BF16_MS = [4]  # at QUICK_KN
TARGET_GEOMEAN_MATMUL_LARGE_M = 1.1  # M >= 16
TARGET_GEOMEAN_MATMUL_SMALL_M = 1.25  # M <= 4
TARGET_GEMM_V2_V1 = 1.05  # the tree order (v2) within 5% of one chain (v1), geomean over every gemm case
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
    return Case(
        name,
        "geomean of group baselines",
        "geomean of group candidates",
        base,
        cand,
        cand / base,
        target,
        extra={"aggregate": True, "cases_in_group": len(cases)},
    )


def _bf16_gemm_cases(options: BenchOptions, g: torch.Generator, progress: Callable[[str], None]) -> list[Case]:
    """F.linear against bi.linear in bfloat16 (no target: a figure to know, not a goal)."""
    k, n = QUICK_KN[0] if options.quick else BF16_KN
    w = torch.randn(n, k, generator=g).bfloat16()
    cases = []
    for m in QUICK_BF16_MS if options.quick else BF16_MS:
        x = torch.randn(m, k, generator=g).bfloat16()
        name = f"linear bf16 M={m} K={k} N={n}"
        case = compare(
            name, ("F.linear", lambda x=x: F.linear(x, w)), ("bi.linear", lambda x=x: bi.linear(x, w)), options
        )
        case.extra["dtype"] = "bfloat16"
        cases.append(case)
        progress(name)
    return cases


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], object]:
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def ops_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    g = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    big_m: list[Case] = []
    small_m: list[Case] = []
    big_m_v2: list[Case] = []
    small_m_v2: list[Case] = []
    v2_v1: list[Case] = []
    for k, n in QUICK_KN if options.quick else KN:
        w = torch.randn(n, k, generator=g)
        wt = w.t().contiguous()
        p = cpu_matmul.tree_blocks(k)
        for m in QUICK_MS if options.quick else MS:
            x = torch.randn(m, k, generator=g)
            for op, base, cand, b in (
                ("linear", ("F.linear", lambda: F.linear(x, w)), ("bi.linear", lambda: bi.linear(x, w)), w.t()),
                ("matmul", ("torch.matmul", lambda: x @ wt), ("bi.matmul", lambda: bi.matmul(x, wt)), wt),
            ):
                name = f"{op} M={m} K={k} N={n}"
                # the kernel in either order, timed interleaved with the two sides (same run)
                orders = {
                    "v1": lambda x=x, b=b: cpu_matmul.mm(x, b, blocks=1),
                    "v2": lambda x=x, b=b, p=p: cpu_matmul.mm(x, b, blocks=p),
                }
                case = compare(name, base, cand, options, target=None, others=orders)
                case.extra["gflops"] = 2 * m * k * n / case.candidate_s / 1e9
                cases.append(case)
                (big_m if m >= 16 else small_m if m <= 4 else []).append(case)
                v1_s, v2_s = case.extra["v1_s"], case.extra["v2_s"]
                v2_label = f"cpu mm blocks={p} (v2)"
                v2 = Case(
                    f"{op} v2 M={m} K={k} N={n}", base[0], v2_label, case.baseline_s, v2_s, v2_s / case.baseline_s, None
                )
                ratio = Case(
                    f"{op} v2/v1 M={m} K={k} N={n}", "cpu mm blocks=1 (v1)", v2_label, v1_s, v2_s, v2_s / v1_s, None
                )
                cases += [v2, ratio]
                (big_m_v2 if m >= 16 else small_m_v2 if m <= 4 else []).append(v2)
                v2_v1.append(ratio)
                progress(name)
    cases += _bf16_gemm_cases(options, g, progress)
    attention: list[Case] = []
    for kind, shapes in (
        ("prefill", QUICK_PREFILL if options.quick else PREFILL),
        ("decode", QUICK_DECODE if options.quick else DECODE),
    ):
        for b, hq, hkv, t, d in shapes:
            tq = t if kind == "prefill" else 1
            q = torch.randn(b, hq, tq, d, generator=g)
            kk = torch.randn(b, hkv, t, d, generator=g)
            vv = torch.randn(b, hkv, t, d, generator=g)
            causal = kind == "prefill"  # decode: the one query sees the whole cache
            rows = tq * hq // hkv  # query rows per KV head
            name = f"attention {kind} B={b} Hq={hq} Hkv={hkv} Tq={tq} Tk={t} D={d}"
            decode_mha = kind == "decode" and hq == hkv
            case = compare(
                name,
                ("F.scaled_dot_product_attention", _sdpa(q, kk, vv, causal)),
                ("bi.attention", lambda q=q, kk=kk, vv=vv: bi.attention(q, kk, vv)),
                options,
                target=TARGET_DECODE_MHA if decode_mha else None,
            )
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
    if torch.cuda.is_available():
        cases.extend(cuda_cases(options, progress))
    cases.append(_aggregate("matmul+linear geomean M>=16", big_m, TARGET_GEOMEAN_MATMUL_LARGE_M))
    cases.append(_aggregate("matmul+linear geomean M<=4", small_m, TARGET_GEOMEAN_MATMUL_SMALL_M))
    cases.append(_aggregate("matmul+linear v2 geomean M>=16", big_m_v2, TARGET_GEOMEAN_MATMUL_LARGE_M))
    cases.append(_aggregate("matmul+linear v2 geomean M<=4", small_m_v2, TARGET_GEOMEAN_MATMUL_SMALL_M))
    cases.append(_aggregate("gemm v2/v1 geomean", v2_v1, TARGET_GEMM_V2_V1))
    cases.append(_aggregate("attention geomean", attention, TARGET_ATTENTION_GEOMEAN))
    return cases


# ---------------------------------------------------------------- CUDA: Triton vs cuBLAS / SDPA

TARGET_CUDA_MATMUL_LARGE_M = 1.25  # >= 0.8x cuBLAS throughput for M >= 256 (bf16)
TARGET_CUDA_DECODE = 1 / 0.7  # >= 0.7x SDPA
CUDA_MS = [1, 64, 256, 1024, 4096]
CUDA_KN = [(4096, 4096), (4096, 14336)]
CUDA_DECODE = [(32, 32, 8, 2048, 128), (8, 32, 8, 8192, 128)]  # (B, Hq, Hkv, Tk, D)
CUDA_PREFILL = [(1, 32, 8, 4096, 128)]
CUDA_ROWS = [(4096, 4096)]


def _cuda_compare(
    name: str,
    baseline: tuple[str, Callable[[], object]],
    candidate: tuple[str, Callable[[], object]],
    options: BenchOptions,
    target: float | None,
) -> Case:
    from triton.testing import do_bench

    rep = 20 if options.quick else 100
    base_ms = do_bench(baseline[1], warmup=10, rep=rep)
    cand_ms = do_bench(candidate[1], warmup=10, rep=rep)
    return Case(
        name,
        baseline[0],
        candidate[0],
        base_ms / 1e3,
        cand_ms / 1e3,
        cand_ms / base_ms,
        target,
        extra={"device": torch.cuda.get_device_name()},
    )


def cuda_cases(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    """The Triton backend against cuBLAS / SDPA on the current CUDA device."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cases: list[Case] = []
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 cases: IEEE on both sides
    try:
        for k, n in CUDA_KN[:1] if options.quick else CUDA_KN:
            w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16)
            for m in CUDA_MS[1:3] if options.quick else CUDA_MS:
                x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
                name = f"cuda matmul bf16 M={m} K={k} N={n}"
                case = _cuda_compare(
                    name,
                    ("cuBLAS F.linear", lambda x=x, w=w: F.linear(x, w)),
                    ("bi.linear (triton)", lambda x=x, w=w: bi.linear(x, w)),
                    options,
                    TARGET_CUDA_MATMUL_LARGE_M if m >= 256 else None,
                )
                case.extra["tflops"] = 2 * m * k * n / case.candidate_s / 1e12
                cases.append(case)
                progress(name)
        x = torch.randn(1024, 4096, device=dev, generator=g)
        w = torch.randn(4096, 4096, device=dev, generator=g)
        name = "cuda matmul fp32 M=1024 K=4096 N=4096"
        cases.append(
            _cuda_compare(
                name,
                ("cuBLAS F.linear", lambda: F.linear(x, w)),
                ("bi.linear (triton)", lambda: bi.linear(x, w)),
                options,
                None,
            )
        )
        progress(name)
        for kind, shapes in (
            ("decode", CUDA_DECODE[:1] if options.quick else CUDA_DECODE),
            ("prefill", [] if options.quick else CUDA_PREFILL),
        ):
            for b, hq, hkv, t, d in shapes:
                tq = 1 if kind == "decode" else t
                q = torch.randn(b, hq, tq, d, device=dev, generator=g, dtype=torch.bfloat16)
                kk = torch.randn(b, hkv, t, d, device=dev, generator=g, dtype=torch.bfloat16)
                vv = torch.randn(b, hkv, t, d, device=dev, generator=g, dtype=torch.bfloat16)
                causal = kind == "prefill"
                name = f"cuda attention {kind} bf16 B={b} Hq={hq} Hkv={hkv} Tq={tq} Tk={t} D={d}"
                cases.append(
                    _cuda_compare(
                        name,
                        ("F.scaled_dot_product_attention", _sdpa(q, kk, vv, causal)),
                        ("bi.attention (triton)", lambda q=q, kk=kk, vv=vv: bi.attention(q, kk, vv)),
                        options,
                        TARGET_CUDA_DECODE if kind == "decode" else None,
                    )
                )
                progress(name)
        for m, n in CUDA_ROWS:
            x = torch.randn(m, n, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(n, device=dev, generator=g, dtype=torch.bfloat16)
            for op, base, cand in (
                ("softmax", lambda: torch.softmax(x, -1), lambda: bi.softmax(x)),
                ("rms_norm", lambda: F.rms_norm(x, (n,), w, 1e-6), lambda: bi.rms_norm(x, w, 1e-6)),
            ):
                name = f"cuda {op} bf16 M={m} N={n}"
                cases.append(_cuda_compare(name, (f"torch {op}", base), (f"bi.{op} (triton)", cand), options, None))
                progress(name)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return cases
