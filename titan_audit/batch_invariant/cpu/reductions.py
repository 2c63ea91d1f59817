"""CPU row reductions (sum, mean, softmax, log_softmax, rms_norm) with a reduction order fixed by
the reduced length alone.

Why this is invariant. Torch's own CPU reductions pick their order at run time: a vectorised
cascade inside a row, and when there are few rows and several threads, a split of the row
between threads (two-pass reduction) whose cut points depend on the number of rows. Here every
sum over the last dim is a fixed binary tree built from element-wise adds:

    pad the row to the next power of two P with -0.0 (the exact additive identity:
    x + -0.0 == x for every x, including +0.0), then P/2, P/4, ..., 1 times
    x[..., :h] + x[..., h:]

An element-wise add is one IEEE rounding per element, independent of how torch vectorises or
threads the loop, so the tree, and every bit of its result, depends only on the row's values
and its length. The tree is also pairwise summation, so it is more accurate than a running sum.

A row maximum needs no fixed order: max is exact, so any order gives the same value, except
for the sign of a zero, which `+ 0.0` canonicalises (-0.0 + 0.0 == +0.0). Element-wise log and
rsqrt are per element (tests check their bits do not depend on a value's position in the
buffer, which on some builds decides between a vector and a scalar code path). The float32
exponential is 2**(x * log2(e)) on a buffer whose length leaves no scalar tail (exp2.py), about
4x faster than torch.exp here; float64 keeps torch.exp.

Everything is computed in float32 (float64 stays float64) and rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_audit.batch_invariant.cpu.exp2 import exp_via_exp2


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree; the result drops the last dim."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n), value=-0.0)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x.squeeze(-1)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dim, keepdim, with -0.0 turned into +0.0 (max itself is order-free)."""
    return x.amax(dim=-1, keepdim=True) + 0.0


def _last_dim_first(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Move `dims` to the end and flatten them into one last dim (row-major order of the dims)."""
    rest = [d for d in range(x.dim()) if d not in dims]
    x = x.permute(*rest, *dims)
    return x.reshape(*x.shape[: len(rest)], -1)


def sum_dims(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Sum over `dims` (normalised, distinct) in compute dtype, tree over their flattened extent."""
    dims = sorted(dims)
    out = tree_sum(_last_dim_first(x.to(compute_dtype(x.dtype)), dims))
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in compute dtype."""
    x = x.to(compute_dtype(x.dtype))
    e = exp_via_exp2(x, row_max(x))
    return e.div_(tree_sum(e).unsqueeze(-1))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dim, in compute dtype."""
    x = x.to(compute_dtype(x.dtype))
    shifted = x - row_max(x)
    return shifted.sub_(torch.log(tree_sum(exp_via_exp2(shifted))).unsqueeze(-1))


def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d softmax: y * (g - sum(g * y)), the row sum by the same tree."""
    grad, y = grad.to(y.dtype), y
    return y * (grad - tree_sum(grad * y).unsqueeze(-1))


def log_softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d log_softmax: g - exp(y) * sum(g), the row sum by the same tree."""
    grad = grad.to(y.dtype)
    return grad - exp_via_exp2(y) * tree_sum(grad).unsqueeze(-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) with y = x * rstd * weight and rstd = rsqrt(mean(x^2) + eps) over the last dim."""
    x = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(tree_sum(x * x) / x.shape[-1] + eps).unsqueeze(-1)
    y = x * rstd
    if weight is not None:
        y.mul_(weight.to(x.dtype))
    return y, rstd


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x, grad_weight). grad_x is per row (tree sums over the row); grad_weight sums over
    rows in a fixed tree too (deterministic; it is a batch reduction, so not batch-invariant)."""
    x = x.to(rstd.dtype)
    grad = grad.to(rstd.dtype)
    gw = grad * weight.to(rstd.dtype) if weight is not None else grad
    n = x.shape[-1]
    dot = tree_sum(gw * x).unsqueeze(-1) / n
    grad_x = rstd * gw - x * (rstd * rstd * rstd) * dot
    grad_weight = None
    if weight is not None:
        rows = (grad * x * rstd).reshape(-1, n)
        grad_weight = tree_sum(rows.t())
    return grad_x, grad_weight
