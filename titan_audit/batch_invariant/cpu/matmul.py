"""CPU matmul kernels (mm, bmm) whose row bits depend only on that row, K and the other operand.

Two gemm libraries sit under torch on CPU, and each keeps a row's bits fixed only within a
"kernel family" that it picks from the problem size. The kernels here pin the family by shape
rules that never look at the batch (measured on this machine: 2-core AMD EPYC, AVX512,
torch 2.13.0+cpu, MKL 2024.2, oneDNN 3.12, 1 and 2 threads).

`mm` (float32; also bfloat16/float16, upcast) runs oneDNN's inner-product primitive
(`torch.ops.mkldnn._linear_pointwise`, the op inductor lowers CPU linears to). Every M >= 2
takes one brgemm family whose reduction over K depends on K alone; M == 1 takes a gemv path.
So one real row is padded with one zero row: the rule is "at least 2 rows". The bits do not
depend on the weight's layout ([N, K] or [K, N] storage) nor on A's offset. oneDNN is also
the fast choice here: it dispatches AVX512 kernels on this AMD CPU, where MKL runs AVX2 code,
so the batch-invariant mm beats native `torch.mm` for M >= 4 and costs about 2x a gemv at M=1.

`bmm` (and float64 `mm`) run MKL's sgemm/dgemm, whose families are:

* a block of fewer than 4 rows takes a gemv-like kernel. With 2 threads MKL also splits M
  between threads, so for M in 5..11 the last M % 4 rows land in such a block;
* an output with fewer than 12 columns (N <= 11) takes another path whose row bits depend on M;
* `bmm` falls back to a naive loop when K * M * N < 400 (ATen's small-problem path).

So the row count is padded with zero rows up to a multiple of `ROW_MULTIPLE` (4), at least 4,
and for `bmm` at least enough rows that K * M * N >= `BMM_MIN_WORK`; the column count is padded
with zero columns to at least `MIN_COLS` (16). A's row stride (lda) was measured not to change
any bit, so a strided view of rows needs no copy. The gemm runs through the `out=` overloads
(`aten::mm.out`, `aten::bmm.out`), which the override mode leaves native, so these kernels never
re-enter the mode (the oneDNN op is not an aten op the mode overrides either).

Zero rows and columns are separate outputs and are sliced away, so they change no bit of the
real rows. These padding rules are claims about these two libraries, proven by tests
(tests/batch_invariant/test_matmul.py sweeps random shapes, row subsets, weight layouts and
thread counts 1 and 2), with negative controls showing plain `torch.mm` and oneDNN's own M == 1
path do change bits. The thread count and the oneDNN/MKL versions are in the numerics
fingerprint.

Low-precision inputs (bfloat16, float16) are computed in float32 (their products are exact in
float32) and rounded once at the end.
"""

from __future__ import annotations

import torch

ROW_MULTIPLE = 4
MIN_COLS = 16
BMM_MIN_WORK = 400  # ATen bmm uses a naive kernel below K * M * N == 400


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_rows(m: int, k: int = 1, n: int = MIN_COLS, *, batched: bool = False) -> int:
    """The row count the gemm runs with for m real rows (a function of m's family, never of data)."""
    rows = max(ROW_MULTIPLE, _round_up(m, ROW_MULTIPLE))
    if batched:
        rows = max(rows, _round_up(-(-BMM_MIN_WORK // max(1, k * n)), ROW_MULTIPLE))
    return rows


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


ONEDNN_MIN_ROWS = 2  # oneDNN's inner product takes a gemv path for M == 1


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous, M >= 2) @ weight [N, K].T in float32 on oneDNN's brgemm family."""
    if not torch.backends.mkldnn.is_available():
        raise NotImplementedError(
            "batch_invariant: the CPU float32 mm runs on oneDNN, and this torch build has no oneDNN "
            "(torch.backends.mkldnn.is_available() is False); refusing to fall back to a batch-variant gemm"
        )
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] in a's compute dtype; row i of the result depends on a[i] and b only."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    if out_dtype == torch.float64:
        return bmm(a.unsqueeze(0), b.unsqueeze(0), _batched=False).squeeze(0)
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return a.new_zeros((m, n), dtype=out_dtype)
    a = a.to(torch.float32)
    weight = b.to(torch.float32).t()  # [N, K]; oneDNN reads [N, K] and [K, N] storage alike
    if weight.stride(0) != 1 and weight.stride(1) != 1:
        weight = weight.contiguous()
    if m < ONEDNN_MIN_ROWS:
        padded = a.new_zeros((ONEDNN_MIN_ROWS, k))
        padded[:m] = a
        out = _onednn_linear(padded, weight)[:m]
    else:
        out = _onednn_linear(a.contiguous(), weight)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def bmm(a: torch.Tensor, b: torch.Tensor, *, _batched: bool = True) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; row (j, i) of the result depends on a[j, i] and b[j] only."""
    assert a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    dtype = _compute_dtype(out_dtype)
    batch, m, k = a.shape
    n = b.shape[2]
    if batch == 0 or m == 0 or n == 0 or k == 0:
        return a.new_zeros((batch, m, n), dtype=out_dtype)
    n_pad = max(n, MIN_COLS)
    m_pad = padded_rows(m, k, n_pad, batched=_batched)
    a = a.to(dtype)
    b = b.to(dtype)
    if m_pad != m or a.stride(-1) != 1 or (m > 1 and a.stride(-2) < k):
        padded = a.new_empty((batch, m_pad, k))
        padded[:, :m] = a
        padded[:, m:] = 0.0
        a = padded
    if n_pad != n:
        padded = b.new_zeros((batch, k, n_pad))
        padded[:, :, :n] = b
        b = padded
    out = a.new_empty((batch, m_pad, n_pad))
    if _batched:
        torch.bmm(a, b, out=out)
    else:
        torch.mm(a[0], b[0], out=out[0])
    out = out[:, :m, :n]
    if n_pad != n:
        out = out.contiguous()
    return out if out.dtype == out_dtype else out.to(out_dtype)
