"""Log-probs through the LM head in row chunks and vocabulary slices (models/chunked_head.py): in BI
mode the log-probs and the gradients of x and of the weight are bitwise those of the unchunked
head + log-softmax + gather, at any chunk size, tied weights included; and no [N, V] tensor lives.

Controls: the weight gradient summed over row chunks that cut the gemm tree's blocks (K = M = 256
is 4 blocks of 64 under v2) has other bits, while the tree's own nodes combined by its halving
tree have the same; a small change of one hidden row changes that row's log-prob alone; the
unchunked path's live bytes exceed the bound the chunked path keeps."""

import pytest
import torch

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant.backend import backend_for
from titan_audit.batch_invariant.order import tree_combine
from titan_audit.live_bytes import LiveBytes
from titan_audit.models import chunked_head, head_rows
from titan_audit.models.logprobs import token_logprobs

from .conftest import SMALL_DENSE

M, D, V, N = 256, 64, 1000, 200  # v2 blocks: K = M 4 (grad_W), K = V 8 (grad_x), K = D 1 (logits)
TEMPERATURE = 0.7
SATURATED = 5  # the row whose target's logit dwarfs the others: log-sum +0.0, log-prob 0.0
# bytes per buffer: (rows per chunk, vocabulary slice width) = (1, 3), (7, 27), (all, all)
CHUNKS = [4 * V, 7 * 4 * V, 1 << 30]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(M, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    rows = torch.randperm(M, generator=g)[:N]  # distinct, unsorted
    targets = torch.randint(0, V, (N,), generator=g)
    x[rows[SATURATED]] = 50 * weight[targets[SATURATED]]
    upstream = torch.randn(N, generator=g)
    return x, weight, rows, targets, upstream


def _run(chunk_bytes: int | None, x: torch.Tensor, weight: torch.Tensor, order: str = "v2"):  # noqa: ANN202
    """(log-probs, grad_x, grad_W) of chunked (chunk_bytes) or unchunked (None) log-probs."""
    _, _, rows, targets, upstream = _inputs()
    x, weight = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with bi.enabled(gemm_order=order):
        if chunk_bytes is None:
            logits = head_rows.head_at_rows(x, weight, rows, None)
            lp = token_logprobs(logits.float() / TEMPERATURE, targets)
        else:
            assert chunked_head.chunked(x, weight)
            lp = chunked_head.logprobs_at_rows(x, weight, rows, targets, TEMPERATURE, None, chunk_bytes=chunk_bytes)
        (lp * upstream).sum().backward()
    return lp.detach(), x.grad, weight.grad


@pytest.mark.parametrize("order", ["v1", "v2"])
@pytest.mark.parametrize("chunk_bytes", CHUNKS, ids=["1row-3cols", "7rows-27cols", "whole"])
def test_chunked_logprobs_and_gradients_have_the_unchunked_bits(chunk_bytes, order):
    x, weight, *_ = _inputs()
    reference = _run(None, x, weight, order)
    assert reference[0][SATURATED].item() == 0.0  # the saturated row is there: log-sum +0.0
    for what, got, want in zip(("log-probs", "grad_x", "grad_W"), _run(chunk_bytes, x, weight, order), reference):
        assert_bitwise_equal(got, want, what)


@pytest.mark.control
def test_a_weight_gradient_over_row_chunks_that_cut_the_tree_has_other_bits():
    x, weight, rows, targets, upstream = _inputs()
    _, _, grad_w = _run(None, x, weight)
    with bi.enabled(gemm_order="v2"):
        logits = head_rows.head_at_rows(x, weight, rows, None).requires_grad_(True)
        (token_logprobs(logits / TEMPERATURE, targets) * upstream).sum().backward()
        grad_MV = torch.zeros(M, V).index_copy_(0, rows, logits.grad)
        mm = backend_for(x).mm
        halves = [mm(grad_MV[h : h + M // 2].t(), x[h : h + M // 2]) for h in (0, M // 2)]
        assert_bitwise_equal(tree_combine(halves), grad_w, "the tree's two subtrees")
        cut = mm(grad_MV[:100].t(), x[:100]) + mm(grad_MV[100:200].t(), x[100:200]) + mm(grad_MV[200:].t(), x[200:])
    assert not bitwise_equal(cut, grad_w)


@pytest.mark.control
def test_a_small_change_of_a_hidden_row_changes_its_log_prob_only():
    x, weight, rows, *_ = _inputs()
    lp, _, grad_w = _run(CHUNKS[1], x, weight)
    nudged = x.clone()
    nudged[rows[3]] += 1e-3
    lp2, _, grad_w2 = _run(CHUNKS[1], nudged, weight)
    assert not bitwise_equal(lp2[3], lp[3])
    keep = torch.arange(N) != 3
    assert_bitwise_equal(lp2[keep], lp[keep], "the other rows' log-probs")
    assert not bitwise_equal(grad_w2, grad_w)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    return models.build(SMALL_DENSE.replace(tie_word_embeddings=request.param), seed=2)


def test_the_model_gives_the_unchunked_logprobs_and_parameter_gradients(model, monkeypatch):
    batch, seq = 4, 64
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    rows = torch.randperm(batch * seq, generator=g)[:150]
    targets = torch.randint(0, model.config.vocab_size, (150,), generator=g)
    upstream = torch.randn(150, generator=g)
    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 11 * 4 * model.config.vocab_size)  # 11 rows, 23 columns

    def run(fused: bool):  # noqa: ANN202
        model.zero_grad(set_to_none=True)
        with bi.enabled():
            if fused:
                lp = model(tokens, logits_rows=rows, logprob_targets=targets, temperature=TEMPERATURE)
            else:
                lp = token_logprobs(model(tokens, logits_rows=rows) / TEMPERATURE, targets)
            (lp * upstream).sum().backward()
        return lp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    lp, grads = run(fused=True)
    want_lp, want_grads = run(fused=False)
    assert_bitwise_equal(lp, want_lp, "log-probs")
    assert grads.keys() == want_grads.keys()
    for name in grads:
        assert_bitwise_equal(grads[name], want_grads[name], name)


def test_live_bytes_stay_below_a_few_chunks_where_the_unchunked_path_holds_logits():
    # V = 4096 and N = 448 of M = 512 rows: one [N, V] float32 is 7.3 MB, a buffer 256 KiB
    vocab, width, m, n, chunk = 4096, 64, 512, 448, 256 << 10
    g = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(vocab, width, generator=g) * 0.1)
    x = torch.randn(m, width, generator=g).requires_grad_(True)
    rows, targets = torch.arange(n) + (m - n), torch.randint(0, vocab, (n,), generator=g)
    # the weight and its gradient, x, its gradient, its selected rows and two packed copies,
    # three buffers and a few floats per row
    bound = 2 * weight.nbytes + 5 * x.nbytes + 3 * chunk + 64 * n

    def peak(chunked: bool) -> int:
        weight.grad = x.grad = None
        with LiveBytes() as tracker, bi.enabled():
            if chunked:
                lp = chunked_head.logprobs_at_rows(x, weight, rows, targets, 1.0, None, chunk_bytes=chunk)
            else:
                lp = token_logprobs(head_rows.head_at_rows(x, weight, rows, None), targets)
            lp.sum().backward()
        return tracker.peak["cpu"]

    assert peak(chunked=True) < bound
    assert peak(chunked=False) > bound + n * vocab * 4  # control: the unchunked path holds [N, V] logits and more


def test_arguments_are_checked():
    x, weight, rows, targets, _ = _inputs()
    call = chunked_head.logprobs_at_rows
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1000\)"):
        call(x, weight, rows, torch.full((N,), V), 1.0, None)
    with pytest.raises(ValueError, match="1-D integer tensor like rows"):
        call(x, weight, rows, targets[:-1], 1.0, None)
    with pytest.raises(ValueError, match="1-D integer tensor like rows"):
        call(x, weight, rows, targets.float(), 1.0, None)
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            call(x, weight, rows, targets, bad, None)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
            call(x, weight, rows, targets, 1.0, None, chunk_bytes=bad)
    model = models.build(SMALL_DENSE, seed=2)
    with pytest.raises(ValueError, match="logprob_targets needs logits_rows"):
        model(torch.zeros(1, 4, dtype=torch.long), logprob_targets=torch.zeros(4, dtype=torch.long))


def test_outside_bi_mode_the_unchunked_path_runs():
    x, weight, rows, targets, _ = _inputs()
    assert not chunked_head.chunked(x, weight)
    got = chunked_head.logprobs_at_rows(x, weight, rows, targets, TEMPERATURE, None)
    want = token_logprobs(head_rows.head_at_rows(x, weight, rows, None) / TEMPERATURE, targets)
    assert_bitwise_equal(got, want, "native log-probs")


def _native_run(chunk_bytes: int | None, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """(log-probs, grad_x, grad_W) outside BI mode: the native chunked path, or (None) the
    unchunked head + log-softmax + gather."""
    x, weight, rows, targets, upstream = _inputs()
    x, weight = x.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
    if chunk_bytes is None:
        lp = token_logprobs(head_rows.head_at_rows(x, weight, rows, None).float() / TEMPERATURE, targets)
    else:
        assert chunked_head.native_chunked(x, weight, N, chunk_bytes)
        lp = chunked_head.logprobs_at_rows(x, weight, rows, targets, TEMPERATURE, None, chunk_bytes=chunk_bytes)
    (lp * upstream).sum().backward()
    return lp.detach(), x.grad, weight.grad


@pytest.mark.parametrize("chunk_bytes", CHUNKS[:2], ids=["1row", "7rows"])
def test_native_chunks_give_the_unchunked_values_and_the_same_bits_run_to_run(chunk_bytes):
    # native ops promise no bits across paths: the values agree to float rounding
    want = _native_run(None)
    got = _native_run(chunk_bytes)
    for name, a, b in zip(("log-probs", "grad_x", "grad_W"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    for name, a, b in zip(("log-probs", "grad_x", "grad_W"), _native_run(chunk_bytes), got):
        assert_bitwise_equal(a, b, f"native chunked {name}, run to run")
    # control: a perturbed hidden row moves its log-prob
    x, weight, rows, targets, _ = _inputs()
    x[rows[3]] += 0.5
    moved = chunked_head.logprobs_at_rows(x, weight, rows, targets, TEMPERATURE, None, chunk_bytes=chunk_bytes)
    assert not bitwise_equal(moved[3], got[0][3])


def test_native_chunks_keep_a_bf16_head_in_its_dtype():
    lp, grad_x, grad_w = _native_run(CHUNKS[1], torch.bfloat16)
    assert (lp.dtype, grad_x.dtype, grad_w.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    # against the float32 values, to bf16's precision (the weight gradient is summed in float32)
    want_lp, want_x, want_w = _native_run(None)
    torch.testing.assert_close(lp, want_lp, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(grad_x.float(), want_x, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(grad_w.float(), want_w, rtol=5e-2, atol=5e-2)


def test_native_live_bytes_stay_below_a_few_chunks_where_the_unchunked_path_holds_logits():
    vocab, width, m, n, chunk = 4096, 64, 512, 448, 256 << 10
    g = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(vocab, width, generator=g) * 0.1)
    x = torch.randn(m, width, generator=g).requires_grad_(True)
    rows, targets = torch.arange(n) + (m - n), torch.randint(0, vocab, (n,), generator=g)
    # the weight, its gradient and its float32 accumulator, x and its gradient, selected rows,
    # three buffers and a few floats per row
    bound = 3 * weight.nbytes + 3 * x.nbytes + 3 * chunk + 64 * n

    def peak(chunk_bytes: int) -> int:
        weight.grad = x.grad = None
        with LiveBytes() as tracker:
            lp = chunked_head.logprobs_at_rows(x, weight, rows, targets, 1.0, None, chunk_bytes=chunk_bytes)
            lp.sum().backward()
        return tracker.peak["cpu"]

    assert peak(chunk) < bound
    assert peak(1 << 30) > bound + n * vocab * 4  # control: one buffer holds it all: the unchunked path
