"""Triton embedding weight gradient (batch_invariant/gpu/embedding.py) in Triton's interpreter on
CPU tensors (marker `triton`), against the CPU kernel (cpu/embedding.py), bitwise.

Checked: the Triton kernel's bits are the CPU kernel's (repeated indices, padding_idx, indices
out of [0, V), untouched rows +0.0, a row of -0.0 grads +0.0, odd D, a bfloat16 grad, [B, T]
indices); the D block width (how many programs share a row) never changes the bits; a row's
gradient is the same whatever unrelated rows share the batch and where they sit, as long as its
own positions keep their order. Negative controls: the same rows in another order (reversed, or
shuffled; or the row's own positions reordered among unrelated ones) give other bits, so the
bitwise checks can fail. BI mode routes F.embedding's backward to
the Triton kernel under the forced backend (a spy) with the CPU kernel's bits; the tied path
(models/tied.py) on the Triton backend gives the CPU backend's bits and the plain path's bits.
Both backends provide every `Backend` name.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from batch_invariant._triton import triton_on_cpu

from titan_audit import batch_invariant as bi
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant import backend, mode
from titan_audit.batch_invariant.cpu.embedding import embedding_backward as cpu_embedding_backward
from titan_audit.models import tied

pytestmark = pytest.mark.triton

V, D, B, T = 50, 37, 3, 100  # D odd; tokens in [0, 40): rows 40.. untouched (41: -0.0 grads only)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """grad [B, T, D] with rows of very different size (cancellation), tokens [B, T]."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, 40, (B, T)))
    scale = (10.0 ** (3 * rng.integers(-1, 2, (B, T, 1)))).astype(np.float32)
    grad = torch.from_numpy(rng.standard_normal((B, T, D)).astype(np.float32) * scale)
    tokens[0, 5], tokens[2, 9] = 41, 41
    grad[0, 5], grad[2, 9] = -0.0, -0.0
    tokens[1, 0], tokens[1, 1] = V + 5, -2  # out of [0, V): add nothing, as in the CPU kernel
    return grad, tokens


def _segment_sum(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
    from titan_audit.batch_invariant.gpu.embedding import segment_sum

    return segment_sum(*args, **kwargs)


@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_triton_kernel_has_the_cpu_kernels_bits(padding_idx: int) -> None:
    grad, tokens = _inputs()
    want = cpu_embedding_backward(grad, tokens, V, padding_idx)
    with triton_on_cpu() as be:
        got = be.embedding_backward(grad, tokens, V, padding_idx)
        got_bf16 = be.embedding_backward(grad.bfloat16(), tokens, V, padding_idx)
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(got_bf16, cpu_embedding_backward(grad.bfloat16(), tokens, V, padding_idx))
    present = set(tokens.reshape(-1).tolist())
    assert 3 in present and 40 not in present
    zero_rows = [v for v in range(V) if v not in present or v == padding_idx] + [41]
    for v in zero_rows:  # +0.0: untouched, padding, and where only -0.0 was added
        assert got[v].eq(0).all() and not torch.signbit(got[v]).any(), v


def test_the_block_width_never_changes_the_bits() -> None:
    grad, tokens = _inputs(1)
    want = cpu_embedding_backward(grad, tokens, V)
    with triton_on_cpu():
        for block_d in (4, 16, 64):  # 10, 3 and 1 programs per row
            assert_bitwise_equal(_segment_sum(grad, tokens, V, block_d=block_d), want, f"block_d {block_d}")
        with pytest.raises(ValueError, match="block_d 12"):
            _segment_sum(grad, tokens, V, block_d=12)


def _rebatched(grad: torch.Tensor, tokens: torch.Tensor, keep: set[int], seed: int, shuffle_kept: bool):  # noqa: ANN202
    """The positions of the rows in `keep` (in their order, or shuffled), interleaved at random
    places with other, unrelated positions (other tokens, other grads, another batch size)."""
    g, t = grad.reshape(-1, D), tokens.reshape(-1)
    mine = torch.tensor([i for i in range(t.numel()) if int(t[i]) in keep])
    rng = np.random.default_rng(seed)
    if shuffle_kept:
        mine = mine[torch.from_numpy(rng.permutation(mine.numel()))]
    others = 170
    other_tokens = torch.from_numpy(rng.integers(10, 40, others))
    other_grad = torch.from_numpy(rng.standard_normal((others, D)).astype(np.float32) * 1e3)
    slots = np.sort(rng.choice(mine.numel() + others, mine.numel(), replace=False))
    new_g, new_t = torch.empty(mine.numel() + others, D), torch.empty(mine.numel() + others, dtype=torch.int64)
    is_mine = np.zeros(mine.numel() + others, dtype=bool)
    is_mine[slots] = True
    new_g[torch.from_numpy(is_mine)], new_t[torch.from_numpy(is_mine)] = g[mine], t[mine]
    new_g[torch.from_numpy(~is_mine)], new_t[torch.from_numpy(~is_mine)] = other_grad, other_tokens
    return new_g, new_t


def test_a_rows_gradient_does_not_depend_on_the_rest_of_the_batch() -> None:
    grad, tokens = _inputs(2)
    keep = set(range(10))
    with triton_on_cpu() as be:
        full = be.embedding_backward(grad, tokens, V)
        other = be.embedding_backward(*_rebatched(grad, tokens, keep, seed=3, shuffle_kept=False), V)
        # control: the same batch with the kept rows' own positions reordered
        shuffled = be.embedding_backward(*_rebatched(grad, tokens, keep, seed=3, shuffle_kept=True), V)
    assert_bitwise_equal(other[:10], full[:10])
    assert not bitwise_equal(other[10:40], full[10:40])  # the unrelated rows did change
    assert not bitwise_equal(shuffled[:10], full[:10])


@pytest.mark.control
def test_negative_control_another_order_gives_other_bits() -> None:
    grad, tokens = _inputs(4)
    g, t = grad.reshape(-1, D), tokens.reshape(-1).clamp(0, V - 1)
    perm = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(5))
    with triton_on_cpu() as be:
        ascending = be.embedding_backward(g, t, V)
        reversed_rows = be.embedding_backward(g.flip(0), t.flip(0), V)  # each row summed descending
        shuffled = be.embedding_backward(g[perm], t[perm], V)  # each row summed in the shuffled order
    assert_bitwise_equal(ascending, cpu_embedding_backward(g, t, V))
    assert not bitwise_equal(ascending, reversed_rows)
    assert not bitwise_equal(ascending, shuffled)
    assert torch.allclose(ascending, shuffled, rtol=1e-4, atol=1e-2)  # same sums, other roundings


def test_bi_mode_routes_embedding_backward_to_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    grad, tokens = _inputs(6)
    calls = []
    with triton_on_cpu() as be:
        kernel = be.embedding_backward

        def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(args[2])
            return kernel(*args, **kwargs)

        monkeypatch.setattr(be, "embedding_backward", spy)
        weight = torch.zeros(V, D, requires_grad=True)
        with bi.enabled():
            F.embedding(tokens.clamp(0, V - 1), weight, padding_idx=3).backward(grad)
    assert calls == [V]
    assert_bitwise_equal(weight.grad, cpu_embedding_backward(grad, tokens.clamp(0, V - 1), V, 3))


def test_deferred_cases_are_refused_off_cpu() -> None:
    """scale_grad_by_freq / float64 run ATen's CPU kernel on CPU; elsewhere (here a meta tensor,
    standing for CUDA) they raise instead of reaching a native kernel."""
    grad, idx = torch.empty(4, 3, device="meta"), torch.zeros(4, dtype=torch.int64, device="meta")
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq on meta"):
        mode._embedding_backward(None, grad, idx, 10, -1, True)


def _tied_grad(tokens: torch.Tensor, g_emb: torch.Tensor) -> torch.Tensor:
    """The tied weight's gradient through models/tied.py: the head's part is exact (small integers,
    the same bits on any backend), the embedding's part is the kernel's fixed-order sum of g_emb."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(12, 8, generator=gen).requires_grad_()
    signs = torch.randint(0, 2, (1, 6, 8), generator=gen) * 2 - 1
    h = (signs * torch.randint(1, 3, (1, 6, 8), generator=gen)).float()
    upstream = torch.randint(-2, 3, (1, 6, 12), generator=gen).float()
    with bi.enabled():
        link = tied.TiedLink()
        emb = tied.embedding(tokens, weight, link)
        logits = tied.head(h + emb * 0.0, weight, link)  # the head's input depends on the embedding
        ((logits * upstream).sum() + (emb * g_emb).sum()).backward()
    return weight.grad


def test_tied_path_on_the_triton_backend_has_the_cpu_backends_bits() -> None:
    tokens = torch.tensor([[1, 3, 1, 7, 1, 3]])
    rng = np.random.default_rng(8)
    scale = (10.0 ** (3 * rng.integers(-1, 2, (1, 6, 1)))).astype(np.float32)
    g_emb = torch.from_numpy(rng.standard_normal((1, 6, 8)).astype(np.float32) * scale)
    cpu = _tied_grad(tokens, g_emb)
    with triton_on_cpu():
        assert tied.applies(torch.zeros(2, 2, requires_grad=True))
        triton = _tied_grad(tokens, g_emb)
    assert_bitwise_equal(triton, cpu)
    # control: row 1's positions in another order give other bits (the head's part is unchanged)
    assert not bitwise_equal(_tied_grad(tokens, g_emb[:, [4, 1, 2, 3, 0, 5]]), cpu)


def test_tied_path_on_the_triton_backend_has_the_plain_paths_bits() -> None:
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(9))
    tokens = torch.tensor([[1, 3, 1, 7]])
    h = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(10))
    upstream = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(11))
    grads = []
    with triton_on_cpu():
        for linked in (True, False):
            w = weight.clone().requires_grad_()
            with bi.enabled():
                link = tied.TiedLink()
                emb = tied.embedding(tokens, w, link) if linked else F.embedding(tokens, w)
                x = h + emb
                logits = tied.head(x, w, link) if linked else bi.linear(x, w)
                (logits * upstream).sum().backward()
            grads.append(w.grad)
    assert_bitwise_equal(grads[0], grads[1])


def test_both_backends_provide_every_backend_name() -> None:
    names = [n for n in backend.Backend.__dict__ if not n.startswith("_")] + list(backend.Backend.__annotations__)
    with triton_on_cpu() as gpu:
        from titan_audit.batch_invariant import cpu

        for module in (cpu, gpu):
            missing = [n for n in names if not hasattr(module, n)]
            assert not missing, (module.__name__, missing)
    assert "embedding_backward" in names


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_atomics_or_fma() -> None:
    """The compiled path (no GPU needed: Triton's wheel has ptxas) is built, uses no atomics, and
    adds with plain add.f32 (no fma contracted: nothing to contract, and fp fusion is off)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from titan_audit.batch_invariant.gpu import embedding

    kernel = embedding._embedding_backward_kernel
    ptrs = {"grad_ptr": "*fp32", "pos_ptr": "*i64", "row_ptr": "*i64", "start_ptr": "*i64", "end_ptr": "*i64"}
    sig = {**ptrs, "out_ptr": "*fp32", "d": "i32", "BLOCK_D": "constexpr"}
    src = ASTSource(fn=kernel, signature=sig, constexprs={"BLOCK_D": 1024})
    options = {"num_warps": 4, "num_stages": 2, "enable_fp_fusion": False}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert not re.search(r"^\s*(@%p\d+\s+)?(atom|red)\.", ptx, flags=re.MULTILINE)
    assert "add.f32" in ptx or "add.rn.f32" in ptx
    assert not re.search(r"\bfma\.", ptx)
