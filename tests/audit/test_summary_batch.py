"""The batched hash path: our xxh3 kernel (batch_invariant/cpu/digest.py) gives python-xxhash's
digest for every size class of xxh3, thread count and ISA variant, and summarize_many /
summarize_batch give summarize()'s bits for every kind of tensor; controls: one flipped byte
moves that item's digest and no other."""

import ctypes

import numpy as np
import pytest
import torch
import xxhash

from titan_audit.audit.fingerprint import whole_hash_limit
from titan_audit.audit.summary import batch_meta, batch_metas, summarize, summarize_batch, summarize_many
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu.digest import xxh3_128_many

# xxh3-128's code paths by input length: 0, 1-3, 4-8, 9-16, 17-128, 129-240, then stripes and
# blocks (1024-byte stripes of 64 bytes; the streaming buffer holds 256 bytes)
SIZES = [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 240, 241, 255, 256, 257, 1023, 1024, 1025, 5000, 70_000, 600_000]


def _items():
    rng = np.random.default_rng(7)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]
    headers = [bytes(rng.integers(0, 256, k, dtype=np.uint8)) for k in rng.integers(0, 60, len(SIZES))]
    return headers, datas


def _reference(headers, datas):
    out = []
    for header, data in zip(headers, datas):
        hasher = xxhash.xxh3_128(header)
        hasher.update(data.tobytes())
        out.append(hasher.hexdigest())
    return out


@pytest.mark.parametrize("isa", _lib.available_isas())
def test_kernel_is_python_xxhash_at_every_size_thread_count_and_isa(isa):
    headers, datas = _items()
    expected = _reference(headers, datas)
    assert len(set(expected)) == len(expected)
    with _lib.forced_isa(isa):
        for threads in (1, 2, 3, 8):
            got = xxh3_128_many(headers, [d.ctypes.data for d in datas], [d.nbytes for d in datas], threads)
            assert got == expected, (isa, threads)


def test_control_one_flipped_byte_moves_only_its_digest():
    headers, datas = _items()
    before = xxh3_128_many(headers, [d.ctypes.data for d in datas], [d.nbytes for d in datas], 2)
    k = SIZES.index(600_000)
    datas[k][12345] ^= 0x10
    after = xxh3_128_many(headers, [d.ctypes.data for d in datas], [d.nbytes for d in datas], 2)
    assert after[k] != before[k]
    assert after[:k] + after[k + 1 :] == before[:k] + before[k + 1 :]
    assert after == _reference(headers, datas)


def test_kernel_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 headers, 1 addresses"):
        xxh3_128_many([b"a", b"b"], [0], [0, 0])


def _tensors():
    rng = np.random.default_rng(3)
    base = torch.from_numpy(rng.standard_normal((64, 48)).astype(np.float32))
    return [
        base,
        base.to(torch.bfloat16),
        base.double(),
        base.t(),  # not contiguous: summarize's own path
        base[::2],
        torch.from_numpy(rng.integers(-(2**40), 2**40, (5, 7))),
        torch.from_numpy(rng.integers(0, 2, 33).astype(np.bool_)),
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 4),
        torch.nn.Parameter(base * 2),
        torch.from_numpy(rng.standard_normal(300_000).astype(np.float32)),  # 1.2 MB
    ]


@pytest.mark.parametrize("limit", [None, 1024])  # 1024: the larger tensors take the lattice path
def test_summarize_many_is_summarize_without_statistics(limit):
    tensors = _tensors()
    with whole_hash_limit(limit) if limit is not None else whole_hash_limit(2 << 20):
        expected = [summarize(t, with_stats=False) for t in tensors]
        assert len({s.hash for s in expected}) == len(expected)
        for threads in (1, 2, 4):
            assert summarize_many(tensors, threads=threads) == expected
        picked = [t for t in tensors if batch_meta(t) is not None]
        assert len(picked) < len(tensors)  # some go the one-by-one path
        metas = [batch_meta(t) for t in picked]
        assert summarize_batch(picked, metas, 2) == [summarize(t, with_stats=False) for t in picked]


def test_control_summarize_many_sees_a_changed_element():
    tensors = _tensors()
    before = summarize_many(tensors, threads=2)
    big = tensors[-1]  # shares no memory with the others
    big[123_456] = torch.nextafter(big[123_456], torch.tensor(10.0))  # one ulp
    after = summarize_many(tensors, threads=2)
    assert after[-1].hash != before[-1].hash
    assert after[:-1] == before[:-1]


def test_batch_meta_takes_plain_contiguous_cpu_tensors_of_at_most_c_bytes():
    t = torch.zeros(16, 16)
    assert batch_meta(t).nbytes == 1024
    assert batch_meta(t.t()) is None
    with whole_hash_limit(1023):
        assert batch_meta(t) is None
    assert ctypes.sizeof(batch_meta(t).buffer) == 1024


def test_batch_metas_is_batch_meta_of_each_or_none_when_one_is_not_taken():
    """batch_metas (the step-level calls' check) is [batch_meta(t) ...] when every tensor is
    taken, and None as soon as one is not: transposed, above C, or a conj view."""
    ts = [torch.zeros(16, 16), torch.ones(3, dtype=torch.bfloat16), torch.tensor(2.0), torch.zeros(0, 4)]
    assert batch_metas(ts) == [batch_meta(t) for t in ts]
    assert batch_metas([]) == []
    assert batch_metas([*ts, ts[0].t()]) is None
    assert batch_metas([torch.zeros(2, dtype=torch.complex64).conj(), *ts]) is None
    with whole_hash_limit(1023):
        assert batch_metas(ts) is None
        assert batch_metas(ts[1:]) == [batch_meta(t) for t in ts[1:]]
