"""Triton gemm: a persistent kernel with one fixed tile configuration per dtype, no split-K inside a
gemm-order block (the v2 blocks and their fixed tree: "Gemm order" below).

Guarantee: C[i, j] of `mm(a, b)` (and of every matrix of `bmm`) is computed by the same
instruction sequence whatever M (the row count), the batch, or which program ran the tile:
  acc = 0 (float32; float64 for float64 inputs)
  for k0 in 0, BK, 2*BK, ... < K (ascending):  acc = tl.dot(A[tile rows, k0:k0+BK], B[k0:k0+BK, tile cols], acc)
  C = round(acc (+ bias[j]))   (rounded once to the output dtype)
Why that is batch-invariant:
- the tile shape (BM, BN, BK), warps and stages are fixed per dtype (`CONFIGS`), never chosen from
  M, N or K, so the compiled kernel (and its MMA instructions) is one and the same for every call
  with that dtype and layout;
- there is no split-K: one program owns an output tile and runs the whole K loop in ascending
  order, so nothing ever adds partial sums from different programs (no atomics, no reduction
  whose shape depends on the problem);
- a row's products meet only that row's accumulator: the rows of a tile never mix, and rows past
  M are masked loads of zeros that feed only their own (discarded) outputs;
- K tails are masked to zero on both operands; +0.0 products leave an accumulator's bits alone.
Persistence (a grid of at most one program per multiprocessor, each walking tiles
pid, pid + P, ...) changes only which program computes a tile, never the tile's arithmetic.
Operand layouts: any strides (a transposed weight `w.t()` is read in place); the layout does
change the compiled kernel (strides of 1 are specialised), not the order of the sum.

Gemm order (`batch_invariant.order`, config key `determinism.bi_kernels`): under "v1" the kernel
above is the whole product (one ascending chain over K). Under "v2" (the default) with P = P(K) > 1
the K axis is cut into P contiguous blocks of K / P; block p's partial sum is the kernel above run
on that block alone (its own ascending chain from 0, into a float32 / float64 partial, never
rounded to a lower dtype), and the P partials are combined by the same halving tree as the CPU
backend (`cpu.matmul.tree_combine`: node [lo, hi) = node [lo, mid) + node [mid, hi), IEEE adds),
then the bias is added and the result rounded once. For `mm` the P blocks are one launch (the
blocks are a batch of strided views: which program runs a block never changes its arithmetic);
`bmm` launches once per block. A block's arithmetic depends on the block's operands only, so the
contiguous K-shards of a subtree (tensor parallelism) reproduce the unsharded sum as on the CPU.
The bits are not the CPU backend's (another chain inside a block), only its order of blocks.

Interpreter (CPU tensors, tests): the same kernel; bfloat16/float16 tiles are upcast to float32
before `tl.dot` (`DOT_F32`, see `_runtime`).
float32 inputs use `input_precision="ieee"` (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_audit.batch_invariant.gpu._runtime import interpreted, jit, persistent_grid
from titan_audit.batch_invariant.order import gemm_blocks, tree_combine

# (BM, BN, BK, warps, stages) per input dtype: fixed, never derived from the problem's shape.
CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 3),
    torch.float64: (32, 32, 16, 4, 2),
}
# The interpreter runs a tile as numpy code: smaller fixed tiles keep tests fast.
INTERPRETER_CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int]] = {dt: (16, 16, 16, 1, 1) for dt in CONFIGS}


@jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    s_ab,
    s_am,
    s_ak,
    s_bb,
    s_bk,
    s_bn,
    s_cb,
    s_cm,
    s_cn,
    tiles_per_matrix,
    tiles_n,
    total_tiles,
    num_programs,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    for tile in range(pid, total_tiles, num_programs):
        mat = tile // tiles_per_matrix
        t = tile % tiles_per_matrix
        # grouped order (GROUP_M tile rows walk the tile columns together, for L2 reuse): it picks
        # which tile a program computes next, never how a tile is computed
        tiles_m = tiles_per_matrix // tiles_n
        group = t // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        tm = first_m + (t % (GROUP_M * tiles_n)) % rows_in_group
        tn = (t % (GROUP_M * tiles_n)) // rows_in_group
        rm = tm * BM + tl.arange(0, BM)
        rn = tn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_base = a_ptr + mat.to(tl.int64) * s_ab
        b_base = b_ptr + mat.to(tl.int64) * s_bb
        if c_ptr.dtype.element_ty == tl.float64:
            acc = tl.zeros((BM, BN), dtype=tl.float64)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # ascending, the whole K in this program: no split-K
            kk = k0 + rk
            a = tl.load(
                a_base + rm[:, None].to(tl.int64) * s_am + kk[None, :] * s_ak,
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                b_base + kk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn,
                mask=(kk[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias[None, :].to(acc.dtype)
        c = c_ptr + mat.to(tl.int64) * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _config(a: torch.Tensor) -> tuple[int, int, int, int, int]:
    return (INTERPRETER_CONFIGS if interpreted(a) else CONFIGS)[a.dtype]


def _launch(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """a [batch, M, K] @ b [batch, K, N] (+ bias [N]) -> [batch, M, N] in `out_dtype` (a's dtype
    by default; the accumulator's, unrounded, for the v2 partials)."""
    assert a.dtype == b.dtype and a.dtype in CONFIGS, (a.dtype, b.dtype)
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=out_dtype or a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        c.zero_()
        return c if bias is None else c.add_(bias.to(c.dtype))
    bm, bn, bk, warps, stages = _config(a)
    tiles_n = triton.cdiv(n, bn)
    per_matrix = triton.cdiv(m, bm) * tiles_n
    total = per_matrix * batch
    programs = persistent_grid(a, total)
    interp = interpreted(a)
    launch = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8)
    if not interp:
        launch.update(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    _gemm_kernel[(programs,)](
        a,
        b,
        c,
        bias if bias is not None else c,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        a.stride(2),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        c.stride(2),
        per_matrix,
        tiles_n,
        total,
        programs,
        HAS_BIAS=bias is not None,
        DOT_F32=interp and a.dtype in (torch.bfloat16, torch.float16),
        IEEE=a.dtype == torch.float32 or (interp and a.dtype != torch.float64),
        **launch,
    )
    return c


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    return acc if acc.dtype == dtype else acc.to(dtype)


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N], added to the float32 accumulator), in a's dtype, in the
    process's gemm order (module doc)."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    a, b = _common(a, b)
    (m, k), n = a.shape, b.shape[1]
    p = gemm_blocks(k)
    if p == 1:
        return _launch(a.unsqueeze(0), b.unsqueeze(0), bias)[0]
    bs = k // p  # block p: a[:, p*bs:(p+1)*bs] @ b[p*bs:(p+1)*bs, :], a batch of P strided views
    a_PMB = a.as_strided((p, m, bs), (bs * a.stride(1), a.stride(0), a.stride(1)))
    b_PBN = b.as_strided((p, bs, n), (bs * b.stride(0), b.stride(0), b.stride(1)))
    partials_PMN = _launch(a_PMB, b_PBN, None, _accumulator_dtype(a.dtype))
    return _round(tree_combine(list(partials_PMN)), bias, a.dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; matrix j's rows depend on a[j] and b[j] only; the process's gemm
    order (module doc)."""
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
    a, b = _common(a, b)
    k = a.shape[2]
    p = gemm_blocks(k)
    if p == 1:
        return _launch(a, b, None)
    bs = k // p
    acc = _accumulator_dtype(a.dtype)
    partials = [_launch(a[:, :, i * bs : (i + 1) * bs], b[:, i * bs : (i + 1) * bs, :], None, acc) for i in range(p)]
    return _round(tree_combine(partials), None, a.dtype)
