"""CPU matmul kernels (mm, bmm) whose row bits depend only on that row, K and the other operand.

Why this is invariant. Torch's float32 `mm`/`bmm` on CPU call MKL's sgemm. MKL picks its kernel
family from the problem size, and within a family every output element is the dot of one row of
A with one column of B, reduced over K in an order fixed by K alone. What changes bits is the
*family*: measured on this machine (MKL 2024.2, AVX512, torch 2.13.0+cpu, 1 and 2 threads):

* a block of fewer than 4 rows takes a gemv-like kernel. With 2 threads MKL also splits M
  between threads, so for M in 5..11 the last M % 4 rows land in such a block;
* an output with fewer than 12 columns (N <= 11) takes another path whose row bits depend on M;
* `bmm` falls back to a naive loop when K * M * N < 400 (ATen's small-problem path).

So the kernels fix the family by padding, never by the batch: the row count is padded with zero
rows up to a multiple of `ROW_MULTIPLE` (4), at least 4, and for `bmm` at least enough rows that
K * M * N >= `BMM_MIN_WORK`; the column count is padded with zero columns to at least `MIN_COLS`
(16). Zero rows and columns are separate outputs and are sliced away, so they change no bit of
the real rows. A is handed to MKL row-major (unit inner stride; copied if not): its row stride
(lda) was measured not to change any bit, so a strided view of rows needs no copy.
The gemm itself runs through the `out=` overloads (`aten::mm.out`, `aten::bmm.out`), which the
override mode leaves native, so these kernels never re-enter the mode.

The padding rule is a claim about this MKL, proven by tests (tests/batch_invariant/
test_matmul.py sweeps random shapes, row subsets and thread counts 1 and 2), with a negative
control showing plain `torch.mm` does change bits there. The thread count is part of the numerics
fingerprint; the bits were also measured to be equal for 1 and 2 threads.

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


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] in a's compute dtype; row i of the result depends on a[i] and b only."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]
    m, k = a.shape
    n = b.shape[1]
    if (
        a.dtype == torch.float32 and b.dtype == torch.float32 and m >= ROW_MULTIPLE and m % ROW_MULTIPLE == 0
        and n >= MIN_COLS and a.stride(1) == 1 and (a.stride(0) >= k or m == 1) and k > 0
    ):
        out = a.new_empty((m, n))  # the common case: nothing to pad, straight to MKL
        return torch.mm(a, b, out=out)
    if (
        a.dtype == torch.float32 and b.dtype == torch.float32 and 0 < m < ROW_MULTIPLE and n >= MIN_COLS and k > 0
    ):  # a few rows (a decode step): pad to ROW_MULTIPLE zero rows, then the same MKL call
        padded = a.new_zeros((ROW_MULTIPLE, k))
        padded[:m] = a
        return torch.mm(padded, b, out=a.new_empty((ROW_MULTIPLE, n)))[:m]
    return bmm(a.unsqueeze(0), b.unsqueeze(0), _batched=False).squeeze(0)


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
