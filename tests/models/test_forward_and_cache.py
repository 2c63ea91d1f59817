"""One forward for training, prefill and decode (default numerics, float32 tolerance): caches
reproduce the full forward, rows of different lengths decode together, bad inputs raise
ValueError, and the caches' bookkeeping (room, blocks, views) is right."""

import pytest
import torch

from titan_audit import models

TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture(params=["dense_model", "moe_model", "moe_shared_model"])
def model(request):
    return request.getfixturevalue(request.param)


@torch.no_grad()
def test_input_forms(dense_model, make_tokens):
    tokens = make_tokens(0, 2, 12)
    batched = dense_model(tokens)
    assert batched.shape == (2, 12, 256)
    assert torch.equal(dense_model(tokens[1]), dense_model(tokens[1:2])[0])  # [T]: a batch of one
    assert torch.equal(dense_model(tokens, positions=torch.arange(12)), batched)
    assert torch.equal(dense_model(tokens.int()), batched)
    shifted = dense_model(tokens, positions=torch.arange(12) + 5)
    assert not torch.allclose(shifted, batched)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, t: m(t.float()), "tokens must be int64 or int32"),
        (lambda m, t: m(t[None]), r"tokens must be \[B, T\]"),
        (lambda m, t: m(t + 256), r"token ids must lie in \[0, 256\)"),
        (lambda m, t: m(t, positions=torch.arange(5)), r"positions must be \[T\] or \[B, T\]"),
        (lambda m, t: m(t, positions=torch.arange(12) + 510), r"positions must lie in \[0, 512\)"),
        (lambda m, t: m(t, doc_ids=torch.zeros(2, 11, dtype=torch.long)), "doc_ids must be"),
        (
            lambda m, t: m(t, cache=models.ContiguousKVCache(m.config, 2, 16), doc_ids=torch.zeros_like(t)),
            "cannot be combined with a KV cache",
        ),
        (lambda m, t: m(t, cache=models.ContiguousKVCache(m.config, 3, 16)), "cache holds 3 rows"),
        (lambda m, t: m(t, cache=models.PagedKVCache(m.config, 4, 4)), r"PagedKVCache.batch\(...\)"),
    ],
)
def test_bad_inputs(dense_model, make_tokens, call, match):
    with pytest.raises(ValueError, match=match):
        call(dense_model, make_tokens(0, 2, 12))


@torch.no_grad()
def test_contiguous_cache_prefill_chunks_and_decode_match_full(model, make_tokens):
    tokens = make_tokens(1, 3, 30)
    full = model(tokens)
    cache = models.ContiguousKVCache(model.config, 3, 40)
    pieces = [model(tokens[:, :11], cache=cache), model(tokens[:, 11:20], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(20, 30)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, **TOL)
    assert cache.lengths == [30, 30, 30]


@torch.no_grad()
def test_contiguous_cache_rows_of_different_lengths(model, make_tokens):
    lengths = [5, 17, 9]
    tokens = make_tokens(2, 3, 25)
    cache = models.ContiguousKVCache(model.config, 3, 32)
    for row, n in enumerate(lengths):
        model(tokens[row : row + 1, :n], cache=cache.rows([row]))
    for step in range(4):  # decode all rows together, each at its own position
        new = torch.stack([tokens[r, n + step] for r, n in enumerate(lengths)])[:, None]
        logits = model(new, cache=cache)
        for row, n in enumerate(lengths):
            alone = model(tokens[row : row + 1, : n + step + 1])[0, -1]
            torch.testing.assert_close(logits[row, 0], alone, **TOL)
    assert cache.lengths == [n + 4 for n in lengths]


@torch.no_grad()
def test_paged_cache_continuous_batching(model, make_tokens):
    """Sequences join and leave; blocks are recycled; each decodes as if alone."""
    tokens = make_tokens(3, 4, 40)
    cache = models.PagedKVCache(model.config, num_blocks=24, block_size=4)
    prompt_len = {0: 7, 1: 13, 2: 3, 3: 10}
    done = {}

    def prefill(seq):
        cache.add(seq)
        model(tokens[seq : seq + 1, : prompt_len[seq]], cache=cache.batch([seq]))

    prefill(0)
    prefill(1)
    running = [0, 1]
    for step in range(12):
        if step == 3:
            prefill(2)
            running.append(2)
        if step == 6:
            done[0] = cache.length(0)
            cache.release(0)
            running.remove(0)
            prefill(3)
            running.append(3)
        new = torch.stack([tokens[s, cache.length(s)] for s in running])[:, None]
        positions = [cache.length(s) for s in running]
        logits = model(new, cache=cache.batch(running))
        for row, seq in enumerate(running):
            alone = model(tokens[seq : seq + 1, : positions[row] + 1])[0, -1]
            torch.testing.assert_close(logits[row, 0], alone, **TOL)
    assert done[0] == 7 + 6
    used = sum(len(cache.block_tables[s]) for s in running)
    assert cache.num_free_blocks == 24 - used


def test_cache_room_errors_leave_state_unchanged(dense_model, make_tokens):
    tokens = make_tokens(4, 1, 12)
    cache = models.ContiguousKVCache(dense_model.config, 1, 10)
    with pytest.raises(ValueError, match="KV cache full"):
        dense_model(tokens, cache=cache)
    assert cache.lengths == [0]

    paged = models.PagedKVCache(dense_model.config, num_blocks=3, block_size=4)
    paged.add("a")
    paged.add("b")
    dense_model(tokens[:, :8], cache=paged.batch(["a"]))
    with pytest.raises(ValueError, match="paged KV cache full: 2 blocks needed, 1 free"):
        dense_model(tokens[:, :5], cache=paged.batch(["b"]))
    assert paged.length("b") == 0 and paged.block_tables["b"] == [] and paged.num_free_blocks == 1
    paged.release("a")
    assert paged.num_free_blocks == 3


def test_cache_bookkeeping_errors(dense_model):
    paged = models.PagedKVCache(dense_model.config, num_blocks=4, block_size=4)
    paged.add("a")
    with pytest.raises(ValueError, match="already in the cache"):
        paged.add("a")
    with pytest.raises(ValueError, match="unknown sequence 'b'"):
        paged.batch(["a", "b"])
    with pytest.raises(ValueError, match="distinct"):
        paged.batch(["a", "a"])
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        models.PagedKVCache(dense_model.config, num_blocks=0, block_size=4)
    contiguous = models.ContiguousKVCache(dense_model.config, 2, 8)
    with pytest.raises(ValueError, match="distinct indices"):
        contiguous.rows([0, 2])


def test_token_logprobs(make_tokens):
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    targets = make_tokens(5, 2, 5, vocab=7)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    got = models.token_logprobs(logits, targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    assert models.token_logprobs(logits.bfloat16(), targets).dtype == torch.float32
    with pytest.raises(ValueError, match="targets shape"):
        models.token_logprobs(logits, targets[:, :4])
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 7\)"):
        models.token_logprobs(logits, targets + 7)
    with pytest.raises(ValueError, match="integer tensor"):
        models.token_logprobs(logits, targets.float())


@torch.no_grad()
def test_packed_documents_match_alone_in_tolerance(model, make_tokens):
    tokens = make_tokens(6, 2, 30)
    doc_ids = torch.tensor([[0] * 7 + [1] * 15 + [2] * 8, [5] * 26 + [-1] * 4])
    packed = model(tokens, doc_ids=doc_ids)
    for row, start, end in [(0, 0, 7), (0, 7, 22), (0, 22, 30), (1, 0, 26)]:
        alone = model(tokens[row : row + 1, start:end])[0]
        torch.testing.assert_close(packed[row, start:end], alone, **TOL)
    # explicit positions override the per-document default
    shifted = model(tokens, doc_ids=doc_ids, positions=torch.arange(30))
    assert not torch.allclose(shifted[0, 7:22], packed[0, 7:22])
    assert torch.allclose(shifted[0, :7], packed[0, :7])


def test_paged_fork_bookkeeping(dense_model, make_tokens):
    cache = models.PagedKVCache(dense_model.config, num_blocks=5, block_size=4)
    cache.add("p")
    dense_model(make_tokens(9, 1, 6), cache=cache.batch(["p"]))
    cache.fork("p", "q")
    assert cache.length("q") == 6 and cache.num_free_blocks == 1
    assert torch.equal(cache.k[:, cache.block_tables["q"]], cache.k[:, cache.block_tables["p"]])
    with pytest.raises(ValueError, match="already in the cache"):
        cache.fork("p", "q")
    with pytest.raises(ValueError, match="fork needs 2 blocks, 1 free"):
        cache.fork("p", "r")
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.fork("zzz", "r")
