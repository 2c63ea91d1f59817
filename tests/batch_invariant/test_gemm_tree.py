"""The gemm's tree order (v2, `blocks=P`): equal to an independent path (v1 chains on K-slices then
`tree_combine`), reproduced bit for bit by K-shards combined by the tree, equal on every ISA variant;
negative controls: a sequential combine of the shards and v1 of the whole K differ."""

from __future__ import annotations

import pytest
import torch

from titan_audit.batch_invariant.cpu import _lib, matmul


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def _eq(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))


def _data(m: int, k: int, n: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)


def _reference(a: torch.Tensor, b: torch.Tensor, p: int) -> torch.Tensor:
    bs = a.shape[1] // p
    parts = [matmul.mm(a[:, j * bs : (j + 1) * bs], b[j * bs : (j + 1) * bs], blocks=1) for j in range(p)]
    return matmul.tree_combine(parts)


def test_tree_blocks_rule():
    assert [matmul.tree_blocks(k) for k in (1, 64, 127, 128, 768, 1024, 4096, 96, 384)] == [1, 1, 1, 2, 8, 16, 64, 1, 4]
    for k in (256, 768, 1024, 4096):
        assert matmul.tree_blocks(k // 2) == matmul.tree_blocks(k) // 2


@pytest.mark.parametrize("m,n", [(1, 97), (2, 64), (13, 97), (40, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_equals_reference(m, n, dtype):
    a, b = _data(m, 768, n, dtype)
    p = matmul.tree_blocks(768)
    assert _eq(matmul.mm(a, b, blocks=p), _reference(a, b, p))
    assert _eq(matmul.mm(a, b.t().contiguous().t(), blocks=p), _reference(a, b, p))  # W.t() storage


@pytest.mark.parametrize("k", [768, 1024])
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("m", [2, 16])
def test_shards_reproduce_v2(k, t, m):
    a, b = _data(m, k, 65, torch.bfloat16, seed=k + t)
    full = matmul.mm(a.float(), b.float(), blocks=matmul.tree_blocks(k))
    s = k // t
    parts = [
        matmul.mm(a[:, i * s : (i + 1) * s].float(), b[i * s : (i + 1) * s].float(), blocks=matmul.tree_blocks(s))
        for i in range(t)
    ]
    assert _eq(matmul.tree_combine(parts), full)
    if t == 4:  # negative control: sequential combine is another order
        seq = ((parts[0] + parts[1]) + parts[2]) + parts[3]
        assert not _eq(seq, full)
    assert not _eq(matmul.mm(a.float(), b.float()), full)  # negative control: v1 differs


def test_blocks_one_is_v1_and_variants_agree():
    a, b = _data(13, 768, 97)
    assert _eq(matmul.mm(a, b, blocks=1), matmul.mm(a, b))
    outs = {}
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            outs[isa] = [matmul.mm(a[:m], b, blocks=8) for m in (1, 2, 13)]
    first = next(iter(outs.values()))
    for got in outs.values():
        assert all(_eq(x, y) for x, y in zip(got, first))
    assert _eq(first[2][:2], first[1]) and _eq(first[2][:1], first[0])  # row invariance across paths


def test_bad_blocks():
    a, b = _data(2, 768, 8)
    with pytest.raises(ValueError):
        matmul.mm(a, b, blocks=3)


@pytest.mark.parametrize("m,k,n,blocks", [(40, 4096, 70, 64), (30, 2048, 33, 4), (25, 1536, 64, 8), (1, 4096, 40, 64)])
def test_tree_k_blocked_equals_reference(m, k, n, blocks):
    """Several row tiles and panels: the k-blocked tree (k-blocks of whole tree blocks, stack levels kept
    per tile and panel across k-blocks; blocks of 1024 k wider than a k-block) equals the reference; a row
    alone gives the same bits, on every ISA variant; negative control: v1 differs."""
    a, b = _data(m, k, n, seed=m)
    ref = _reference(a, b, blocks)
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            assert _eq(matmul.mm(a, b, blocks=blocks), ref), isa
            assert _eq(matmul.mm(a, b.t().contiguous().t(), blocks=blocks), ref), isa
            assert _eq(matmul.mm(a[-1:], b, blocks=blocks), ref[-1:]), isa
    assert not _eq(matmul.mm(a, b), ref)
