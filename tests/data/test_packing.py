"""Packing: no token lost or duplicated within an epoch; best-fit never splits a short document;
positions stay in [0, seq_len): a document longer than a row counts from 0 in every piece.

Stores are built from random documents; the reference is the documents themselves. Each property
also checks the per-token doc ids, positions, targets and loss mask against that reference.
"""

import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.data import BestFitPacker, ConcatPacker, TokenStore, write_token_store

EOS, PAD = 1000, 1001


def _store(doc_lengths, seed):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 1000, size=n).astype(np.uint32) for n in doc_lengths]
    tmp = tempfile.mkdtemp(prefix="titan-pack-")
    write_token_store(f"{tmp}/s.zarr", docs, vocab_size=1002, eos_id=EOS, pad_id=PAD)
    return TokenStore(f"{tmp}/s.zarr", cache_chunks=4), docs


doc_lists = st.lists(st.integers(0, 90), min_size=1, max_size=60)


def _check_rows(packer, seq):
    """Targets, positions, doc ids and the loss mask agree with each other and with loss_tokens."""
    L = packer.seq_len
    assert (
        seq.tokens.shape == seq.targets.shape == seq.positions.shape == seq.doc_ids.shape == seq.loss_mask.shape == (L,)
    )
    # the target of position i is the token at i + 1 whenever i + 1 is inside the row
    assert np.array_equal(seq.targets[:-1], seq.tokens[1:])
    same = (
        (seq.doc_ids[:-1] == seq.doc_ids[1:]) & (seq.positions[1:] == seq.positions[:-1] + 1) & (seq.doc_ids[:-1] >= 0)
    )
    assert np.array_equal(seq.loss_mask[:-1], same)
    assert not seq.loss_mask[seq.doc_ids < 0].any()


@settings(max_examples=40)
@given(doc_lists, st.integers(1, 40), st.integers(0, 1000))
def test_concat_covers_the_stream_exactly_once(lengths, seq_len, seed):
    if sum(lengths) + len(lengths) < seq_len + 1:
        return  # too little data for one sequence (a ValueError, tested elsewhere)
    store, docs = _store(lengths, seed)
    packer = ConcatPacker(store, seq_len)
    stream = np.concatenate([np.append(d.astype(np.int64), EOS) for d in docs])
    doc_of = np.concatenate([np.full(len(d) + 1, i) for i, d in enumerate(docs)])
    pos_of = np.concatenate([np.arange(len(d) + 1) for d in docs])
    start_of = np.concatenate([np.full(len(d) + 1, sum(len(e) + 1 for e in docs[:i])) for i, d in enumerate(docs)])
    long_of = np.concatenate([np.full(len(d) + 1, len(d) + 1 > seq_len) for d in docs])
    n = packer.num_sequences
    assert n == (len(stream) - 1) // seq_len
    rows = [packer.sequence(j) for j in range(n)]
    tokens = np.concatenate([r.tokens for r in rows])
    # every slot of the stream, in order, exactly once, up to the final partial window
    assert np.array_equal(tokens, stream[: n * seq_len])
    assert np.array_equal(np.concatenate([r.doc_ids for r in rows]), doc_of[: n * seq_len])
    for j, r in enumerate(rows):  # a long document's positions count from the window's first slot
        slots = np.arange(j * seq_len, (j + 1) * seq_len)
        expected = np.where(long_of[slots], slots - np.maximum(start_of[slots], j * seq_len), pos_of[slots])
        assert np.array_equal(r.positions, expected)
        assert 0 <= r.positions.min() and r.positions.max() < seq_len
    assert np.array_equal(np.concatenate([r.targets for r in rows]), stream[1 : n * seq_len + 1])
    for r in rows:
        _check_rows(packer, r)
    assert np.array_equal(packer.loss_tokens(np.arange(n)), [int(r.loss_mask.sum()) for r in rows])


@settings(max_examples=40)
@given(doc_lists, st.integers(2, 40), st.integers(0, 1000))
def test_best_fit_places_every_token_once_and_never_splits_short_documents(lengths, seq_len, seed):
    store, docs = _store(lengths, seed)
    packer = BestFitPacker(store, seq_len)
    seen = {d: np.full(len(doc) + 1, -1, dtype=np.int64) for d, doc in enumerate(docs)}  # item slot -> token
    rows_of = {d: set() for d in range(len(docs))}
    for j in range(packer.num_sequences):
        r = packer.sequence(j)
        _check_rows(packer, r)
        assert int(r.loss_mask.sum()) == int(packer.loss_tokens(np.array([j]))[0])
        real = r.doc_ids >= 0
        assert real.any()  # no empty bins
        assert np.all(r.tokens[~real] == PAD) and real[: real.sum()].all()  # padding only at the end
        assert r.positions.max() < seq_len
        at = 0
        for d, start, count in packer.bin_pieces(j):  # each piece counts its positions from 0
            assert np.all(r.doc_ids[at : at + count] == d)
            assert np.array_equal(r.positions[at : at + count], np.arange(count))
            assert np.all(seen[d][start : start + count] == -1), f"doc {d} slots {start}.. placed twice"
            seen[d][start : start + count] = r.tokens[at : at + count]
            rows_of[d].add(j)
            at += count
        assert at == real.sum()
    for d, doc in enumerate(docs):
        assert np.array_equal(seen[d], np.append(doc.astype(np.int64), EOS)), f"doc {d} lost or corrupted"
        if len(doc) + 1 <= seq_len:
            assert len(rows_of[d]) == 1, f"doc {d} of {len(doc)} tokens split over {rows_of[d]}"
        else:
            assert len(rows_of[d]) == -(-(len(doc) + 1) // seq_len)


def test_best_fit_is_tighter_than_one_document_per_row():
    store, docs = _store([5, 30, 7, 12, 25, 3, 14, 9, 18, 6], 0)
    packer = BestFitPacker(store, 32)
    assert packer.num_sequences < len(docs)
    fill = sum(len(d) + 1 for d in docs) / (packer.num_sequences * 32)
    assert fill > 0.8
