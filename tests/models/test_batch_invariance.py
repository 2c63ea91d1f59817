"""G2 for the model, in batch-invariant mode, bitwise (raw bits, never allclose):

- KV-cache decode (contiguous and paged, random chunked prefill + decode splits) gives the same
  logits as one full forward over the same tokens, for dense, MoE and MoE with shared expert;
- a sequence's logits are the same alone or in a batch with other sequences of other lengths
  (right-padded with doc_ids = -1, or decoded together from a paged cache);
- a packed document's logits are the same as running it alone;
- token_logprobs of a row do not depend on the other rows;
- bfloat16 weights and cache keep all of the above (paged decode == full forward);
- forked sequences (n samples of one prompt) decode as if alone;
- the G4 flow at model level: log-probs reported during paged greedy decode equal the trainer's
  recomputation from a packed batch.

Each property has a negative control: the same comparison, in BI mode, with one side's linears
in another order of the sum (`linears_in_another_order`: two BI gemms over a K cut in two, added)
or, for packing, with attention over absolute packed positions. The difference is one the test
constructs, so the controls differ on every CPU.
"""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit import models
from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.batch_invariant import enabled
from titan_audit.models import ops

from .conftest import linears_in_another_order

MODELS = ["dense_model", "moe_model", "moe_shared_model"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.getfixturevalue(request.param)


def _chunked_decode(model, tokens, chunks, cache):
    pieces, start = [], 0
    for size in chunks:
        pieces.append(model(tokens[:, start : start + size], cache=cache))
        start += size
    return torch.cat(pieces, 1)


def _splits(total_max=70):
    """(prefill length, list of later chunk sizes): chunked prefill then decode steps."""
    return st.tuples(
        st.integers(1, 40),
        st.lists(st.integers(1, 6), min_size=1, max_size=8),
    )


@settings(max_examples=12)
@given(split=_splits(), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_contiguous_cache_decode_is_bitwise_full_forward(model, make_tokens, split, seed):
    prefill, chunks = split
    chunks = [prefill, *chunks]
    tokens = make_tokens(seed, 2, sum(chunks))
    with enabled():
        full = model(tokens)
        cache = models.ContiguousKVCache(model.config, 2, sum(chunks) + 3)
        assert_bitwise_equal(_chunked_decode(model, tokens, chunks, cache), full, "decode vs full")


@settings(max_examples=12)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    decode_steps=st.integers(1, 6),
    block_size=st.sampled_from([1, 3, 8, 16]),
    seed=st.integers(0, 2**16),
)
@torch.no_grad()
def test_paged_cache_batched_decode_is_bitwise_alone_full_forward(
    model, make_tokens, lengths, decode_steps, block_size, seed
):
    """Prompts of different lengths prefilled one by one, decoded together from a paged cache:
    every step's logits equal the full forward of that sequence alone."""
    tokens = make_tokens(seed, len(lengths), max(lengths) + decode_steps)
    seqs = list(range(len(lengths)))
    with enabled():
        cache = models.PagedKVCache(model.config, num_blocks=64, block_size=block_size)
        outputs = {s: [] for s in seqs}
        for s, n in enumerate(lengths):
            cache.add(s)
            outputs[s].append(model(tokens[s : s + 1, :n], cache=cache.batch([s]))[0])
        for step in range(decode_steps):
            new = torch.stack([tokens[s, lengths[s] + step] for s in seqs])[:, None]
            logits = model(new, cache=cache.batch(seqs))
            for s in seqs:
                outputs[s].append(logits[s])
        for s, n in enumerate(lengths):
            alone = model(tokens[s : s + 1, : n + decode_steps])[0]
            assert_bitwise_equal(torch.cat(outputs[s]), alone, f"paged decode of sequence {s}")


@settings(max_examples=12)
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=4), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_sequence_alone_or_in_padded_batch(model, make_tokens, lengths, seed):
    width = max(lengths)
    tokens = make_tokens(seed, len(lengths), width)
    doc_ids = torch.full((len(lengths), width), -1)
    for row, n in enumerate(lengths):
        doc_ids[row, :n] = 0
    with enabled():
        batched = model(tokens, doc_ids=doc_ids)
        for row, n in enumerate(lengths):
            alone = model(tokens[row : row + 1, :n])[0]
            assert_bitwise_equal(batched[row, :n], alone, f"row {row} of a padded batch vs alone")
        assert torch.isfinite(batched).all()
        # Same-length rows need no doc_ids at all: one row alone == that row in the batch.
        same = model(tokens[:, : min(lengths)])
        assert_bitwise_equal(same[-1], model(tokens[-1:, : min(lengths)])[0], "equal-length batch")


@settings(max_examples=12)
@given(
    docs=st.lists(st.integers(1, 25), min_size=1, max_size=5),
    row_width=st.integers(25, 60),
    seed=st.integers(0, 2**16),
)
@torch.no_grad()
def test_packed_document_is_bitwise_alone(model, make_tokens, docs, row_width, seed):
    """Greedy packing of random documents into rows (padding at row ends)."""
    rows, current = [], []
    for doc, n in enumerate(docs):
        if sum(m for _, m in current) + n > row_width:
            rows.append(current)
            current = []
        current.append((doc, n))
    rows.append(current)
    stream = make_tokens(seed, sum(docs))
    offsets = torch.tensor([0, *docs]).cumsum(0).tolist()
    tokens = torch.zeros(len(rows), row_width, dtype=torch.long)
    doc_ids = torch.full((len(rows), row_width), -1)
    where = {}
    for r, row in enumerate(rows):
        col = 0
        for doc, n in row:
            tokens[r, col : col + n] = stream[offsets[doc] : offsets[doc] + n]
            doc_ids[r, col : col + n] = doc
            where[doc] = (r, col, n)
            col += n
    with enabled():
        packed = model(tokens, doc_ids=doc_ids)
        for doc, (r, col, n) in where.items():
            alone = model(stream[offsets[doc] : offsets[doc] + n][None])[0]
            assert_bitwise_equal(packed[r, col : col + n], alone, f"document {doc} packed vs alone")


@torch.no_grad()
def test_token_logprobs_row_invariant(dense_model, make_tokens):
    tokens = make_tokens(7, 5, 33)
    with enabled():
        logits = dense_model(tokens)
        batched = models.token_logprobs(logits[:, :-1], tokens[:, 1:])
        for row in range(5):
            single = models.token_logprobs(logits[row, :-1], tokens[row, 1:])
            assert_bitwise_equal(single, batched[row], f"log-probs of row {row}")


# --- negative controls: the same comparisons, one side's linears in another order of the sum -----


@pytest.mark.control
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_negative_control_decode_in_another_order_differs(request, make_tokens, monkeypatch, name):
    model = request.getfixturevalue(name)
    tokens = make_tokens(3, 3, 70)
    with enabled():
        full = model(tokens)
        cache = models.ContiguousKVCache(model.config, 3, 70)
        with linears_in_another_order(monkeypatch):
            decoded = _chunked_decode(model, tokens, [33] + [1] * 37, cache)
    assert not bitwise_equal(decoded, full)
    torch.testing.assert_close(decoded, full, atol=1e-5, rtol=0)  # same math, other bits


@pytest.mark.control
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_negative_control_alone_in_another_order_differs(request, make_tokens, monkeypatch, name):
    model = request.getfixturevalue(name)
    tokens = make_tokens(3, 3, 70)
    with enabled():
        batched = model(tokens)
        with linears_in_another_order(monkeypatch):
            alone = model(tokens[1:2, :50])[0]
    assert not bitwise_equal(alone, batched[1, :50])
    torch.testing.assert_close(alone, batched[1, :50], atol=1e-5, rtol=0)


@pytest.mark.control
@torch.no_grad()
def test_negative_control_packing_needs_per_document_attention(make_tokens):
    """Attention over the packed row at absolute positions (a doc mask instead of per-document
    segments) gives a document at an offset other bits than alone, even in BI mode: the BI
    kernel reduces keys in chunks aligned to absolute positions, and a document at offset 100
    straddles the 128-key chunk boundary that it does not cross alone. Hence the segment layout."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 170, 16, generator=generator) for _ in range(3))
    doc_ids = torch.tensor([[0] * 100 + [1] * 70])
    positions = torch.arange(170)[None]
    with enabled():
        assert ops.bi_mode()
        masked = ops.attention(q, k, v, positions, doc_ids)[:, :, 100:]
        alone = ops.attention(q[:, :, 100:], k[:, :, 100:], v[:, :, 100:], positions[:, :70])
    torch.testing.assert_close(masked, alone, atol=1e-5, rtol=0)
    assert not bitwise_equal(masked, alone)


@pytest.mark.parametrize(
    "control", [False, pytest.param(True, marks=pytest.mark.control)], ids=["bi", "negative-control-another-order"]
)
@torch.no_grad()
def test_bfloat16_moe_paged_decode(make_tokens, monkeypatch, control):
    """bfloat16 weights and cache (MoE, expert width 36: pointwise tails occur): paged decode is
    bitwise the full forward in BI mode. Negative control: the same comparison with the decode's
    linears in another order of the sum differs."""
    config = models.ModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=100,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=36,
    )
    model = models.build(config, seed=4, dtype=torch.bfloat16).eval()
    tokens = make_tokens(8, 3, 40)
    with enabled():
        full = model(tokens)
        cache = models.PagedKVCache(config, num_blocks=32, block_size=8, dtype=torch.bfloat16)
        with linears_in_another_order(monkeypatch) if control else contextlib.nullcontext():
            pieces = []
            for s in range(3):
                cache.add(s)
                pieces.append(model(tokens[s : s + 1, :15], cache=cache.batch([s])))
            prefill = torch.cat(pieces)
            steps = [model(tokens[:, t : t + 1], cache=cache.batch([0, 1, 2])) for t in range(15, 40)]
            decoded = torch.cat([prefill, *steps], 1)
    assert full.dtype == decoded.dtype == torch.bfloat16
    assert bitwise_equal(decoded, full) != control


@pytest.mark.parametrize(
    "control", [False, pytest.param(True, marks=pytest.mark.control)], ids=["bi", "negative-control-another-order"]
)
@torch.no_grad()
def test_generator_logprobs_equal_packed_trainer_recomputation(moe_model, make_tokens, monkeypatch, control):
    """The G4 flow at model level: greedy continuous-batching decode from a paged cache records
    the log-prob of each chosen token; the trainer recomputes them from a packed batch of the
    full sequences. Bitwise equal in BI mode; negative control: not when the generator's linears
    sum in another order."""
    prompts = [make_tokens(30 + i, n) for i, n in enumerate([5, 11, 8])]
    new_tokens = 6
    with enabled(), linears_in_another_order(monkeypatch) if control else contextlib.nullcontext():
        cache = models.PagedKVCache(moe_model.config, num_blocks=32, block_size=4)
        last_logits, sequences, reported = [], [], [[] for _ in prompts]
        for s, prompt in enumerate(prompts):
            cache.add(s)
            last_logits.append(moe_model(prompt[None], cache=cache.batch([s]))[0, -1])
            sequences.append(prompt.tolist())
        for _ in range(new_tokens):
            logits = torch.stack(last_logits)
            chosen = logits.argmax(-1)
            logprobs = models.token_logprobs(logits, chosen)
            for s in range(len(prompts)):
                sequences[s].append(int(chosen[s]))
                reported[s].append(logprobs[s])
            step = moe_model(chosen[:, None], cache=cache.batch(range(len(prompts))))
            last_logits = list(step[:, -1])
    with enabled():
        # trainer: one packed row with all sequences, log-probs of the generated tokens
        row = torch.tensor([t for seq in sequences for t in seq])
        doc_ids = torch.cat([torch.full((len(seq),), s) for s, seq in enumerate(sequences)])
        logits = moe_model(row[None], doc_ids=doc_ids[None])[0]
        start, matches = 0, []
        for s, seq in enumerate(sequences):
            prompt_len = len(prompts[s])
            positions = torch.arange(start + prompt_len - 1, start + len(seq) - 1)
            recomputed = models.token_logprobs(logits[positions], row[positions + 1])
            matches.append(bitwise_equal(recomputed, torch.stack(reported[s])))
            start += len(seq)
    assert all(matches) != control


@torch.no_grad()
def test_forked_sequences_decode_bitwise_as_alone(moe_model, make_tokens):
    """n samples of one prompt: prefill once, fork, decode the forks together with different
    continuations; each equals the full forward of its own sequence (BI mode)."""
    prompt = make_tokens(40, 13)
    continuations = make_tokens(41, 3, 5)
    with enabled():
        cache = models.PagedKVCache(moe_model.config, num_blocks=24, block_size=4)
        cache.add(0)
        prefill = moe_model(prompt[None], cache=cache.batch([0]))[0]
        for s in (1, 2):
            cache.fork(0, s)
        steps = [moe_model(continuations[:, t : t + 1], cache=cache.batch([0, 1, 2])) for t in range(5)]
        decoded = torch.cat(steps, 1)
        for s in range(3):
            full = moe_model(torch.cat([prompt, continuations[s]])[None])[0]
            assert_bitwise_equal(prefill, full[:13], "prefill")
            assert_bitwise_equal(decoded[s], full[13:], f"fork {s}")
    assert len({tuple(cache.block_tables[s]) for s in range(3)}) == 3


@pytest.mark.parametrize(
    "control", [False, pytest.param(True, marks=pytest.mark.control)], ids=["bi", "negative-control-another-order"]
)
@torch.no_grad()
def test_head_dim_128_paged_decode_token_by_token_is_bitwise_full_forward(make_tokens, monkeypatch, control):
    """tiny-dense with head_dim=128 (the head_dim of every real Qwen3 model; issue 14: the
    MKL-based attention broke G2 at this shape on AVX-512 CPUs): two prompts prefilled into a
    paged cache, then decoded together token by token past the 128-key chunk boundary; every
    step's logits equal one full forward over the same tokens, bitwise, in BI mode. Negative
    control: the same comparison with the decode's linears in another order of the sum differs."""
    config = models.get_preset("tiny-dense").replace(head_dim=128, num_hidden_layers=2)
    model = models.build(config, seed=6).eval()
    lengths, total = [3, 70], 140
    tokens = make_tokens(10, 2, total, vocab=config.vocab_size)
    with enabled():
        full = model(tokens)
        cache = models.PagedKVCache(config, num_blocks=40, block_size=8)
        pieces: list[list[torch.Tensor]] = [[], []]
        with linears_in_another_order(monkeypatch) if control else contextlib.nullcontext():
            for s, n in enumerate(lengths):
                cache.add(s)
                pieces[s].append(model(tokens[s : s + 1, :n], cache=cache.batch([s]))[0])
            for step in range(total - lengths[1]):  # both rows decode one token per step
                new = torch.stack([tokens[s, lengths[s] + step] for s in (0, 1)])[:, None]
                logits = model(new, cache=cache.batch([0, 1]))
                for s in (0, 1):
                    pieces[s].append(logits[s])
        decoded = [torch.cat(p)[: total - lengths[1] + lengths[s]] for s, p in enumerate(pieces)]
    same = all(bitwise_equal(decoded[s], full[s, : decoded[s].shape[0]]) for s in (0, 1))
    assert same != control
    torch.testing.assert_close(decoded[1], full[1], atol=1e-4, rtol=0)  # same math either way
