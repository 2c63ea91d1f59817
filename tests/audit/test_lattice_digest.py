"""The lattice digest above C bytes (audit/fingerprint.py): its kernel against a numpy rendering
of the documented formula (version 2, and version 1 kept for old checkpoints) on every ISA
variant and thread count, across 4096-word blocks, pieces of any layout adding up to the whole
tensor's digest, today's xxh3 kept up to C, and the controls: a one-element change (any bits of
any word) is always found, two changes inside one block or in two blocks, two swapped elements or
the same bits under another dtype or shape give another digest; version 1's digest is another."""

import math

import numpy as np
import pytest
import torch

from titan_audit.audit import pieces as layout
from titan_audit.audit import shards
from titan_audit.audit.fingerprint import (
    WHOLE_HASH_BYTES,
    fingerprint,
    lattice_digest,
    whole_digest,
    whole_hash_bytes,
    whole_hash_limit,
)
from titan_audit.audit.summary import stats, summarize
from titan_audit.batch_invariant.cpu import _lib, lattice

SMALL_C = 256  # bytes: every tensor here above it goes through the lattice path


def _words(t: torch.Tensor) -> np.ndarray:
    """The documented words of a contiguous tensor (unsigned, 1/2/4 bytes; 8- and 16-byte
    elements as 4-byte words, low half first), built through numpy bytes."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    width = min(t.element_size(), 4)
    return raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width])


def _documented(t: torch.Tensor) -> str:
    words = _words(t)
    return lattice_digest(t.dtype, tuple(t.shape), lattice.reference_lanes(words, np.arange(words.size)))


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex128]


def _tensor(dtype, shape=(37, 29), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 7).to(dtype)


@pytest.mark.parametrize("shape", [(37, 29), (97, 131)], ids=["one-block", "blocks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_above_c_the_digest_is_the_documented_sum_on_every_variant_and_thread_count(dtype, shape):
    t = _tensor(dtype, shape)
    expected = _documented(t)
    with whole_hash_limit(SMALL_C):
        for isa in _lib.available_isas():
            with _lib.forced_isa(isa):
                for threads in (1, 2):
                    lanes = shards.lanes(t, layout.Piece.whole(t.shape), threads=threads)
                    assert lattice_digest(t.dtype, tuple(t.shape), lanes) == expected, (isa, threads)
                assert fingerprint(t) == expected
                assert summarize(t, with_stats=True).hash == expected
                assert summarize(t, with_stats=False).hash == expected


def test_threads_split_a_long_tensor_without_changing_the_lanes():
    t = torch.randn(1 << 20)  # several times the kernel's minimum words per thread
    one = shards.lanes(t, layout.Piece.whole(t.shape), threads=1)
    assert shards.lanes(t, layout.Piece.whole(t.shape), threads=2) == one
    assert shards.lanes(t, layout.Piece.whole(t.shape), threads=3) == one


@pytest.mark.parametrize("version", lattice.VERSIONS)
@pytest.mark.parametrize("width", lattice.WORD_BYTES)
def test_each_version_follows_its_formula_on_every_variant_at_any_start_and_width(version, width):
    """Runs that start inside a block, cross several, end in a vector tail; indices past 2^32."""
    n = 9001
    numpy_type = {1: np.uint8, 2: np.uint16, 4: np.uint32}[width]
    words = np.random.default_rng(width).integers(0, np.iinfo(numpy_type).max, n, dtype=numpy_type, endpoint=True)
    data = torch.from_numpy(words)
    for start in (0, 4090, (1 << 32) - 1000, (5 << 32) + 7):
        ref = lattice.reference_lanes(words, np.arange(start, start + n, dtype=np.uint64), version)
        for isa in _lib.available_isas():
            with _lib.forced_isa(isa), lattice.using_version(version):
                out = lattice.new_lanes()
                lattice.span(out, data.data_ptr(), width, n, start)
                assert (out[0], out[1]) == ref, (isa, start)


def test_control_version_1_gives_another_digest_and_unknown_versions_are_refused():
    t = torch.randn(97, 131)
    with whole_hash_limit(SMALL_C):
        current = fingerprint(t)
        with lattice.using_version(1):
            assert fingerprint(t) != current
        assert fingerprint(t) == current
    with pytest.raises(ValueError, match="unknown digest version 3"):
        with lattice.using_version(3):
            pass


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pieces_of_any_layout_add_up_to_the_whole(dtype):
    t = _tensor(dtype, (11, 13, 6))
    whole = shards.lanes(t, layout.Piece.whole(t.shape))
    cuts = {
        "dim 0, uneven (torch.chunk of 4: 3, 3, 3, 2)": [
            (slice(a, b), slice(None)) for a, b in ((0, 3), (3, 6), (6, 9), (9, 11))
        ],
        "dim 1": [(slice(None), slice(0, 7)), (slice(None), slice(7, 13))],
        "dims 0 and 1": [(slice(a, b), slice(c, d)) for a, b in ((0, 6), (6, 11)) for c, d in ((0, 7), (7, 13))],
    }
    for what, blocks in cuts.items():
        parts = []
        for rows, cols in blocks:
            index = (torch.arange(11)[rows], torch.arange(13)[cols], torch.arange(6))
            parts.append(shards.lanes(t[rows, cols], layout.Piece(tuple(t.shape), index)))
        assert lattice.add_lanes(parts) == whole, what
    # strided index sets (a _StridedShard's): even and odd rows, each a non-contiguous view
    even, odd = torch.arange(0, 11, 2), torch.arange(1, 11, 2)
    parts = [
        shards.lanes(t[i], layout.Piece(tuple(t.shape), (i, torch.arange(13), torch.arange(6)))) for i in (even, odd)
    ]
    assert lattice.add_lanes(parts) == whole
    # positions: the elements of a piece inside another piece
    full = layout.Piece.whole(t.shape)
    top = layout.Piece(tuple(t.shape), (torch.arange(4), torch.arange(13), torch.arange(6)))
    rest = layout.Piece(tuple(t.shape), (torch.arange(4, 11), torch.arange(13), torch.arange(6)))
    pieces = [shards.lanes(t, full, full.positions_in(p)) for p in (top, rest)]
    assert lattice.add_lanes(pieces) == whole


def test_strided_and_transposed_views_hash_as_their_logical_tensor():
    t = torch.randn(64, 48)
    with whole_hash_limit(SMALL_C):
        expected = fingerprint(t.contiguous())
        assert fingerprint(t.t().contiguous().t()) == expected  # column-major memory
        assert fingerprint(torch.randn(64, 96)[:, ::2].copy_(t)) == expected  # a strided view
        assert summarize(t.t().contiguous().t()).hash == expected


@pytest.mark.parametrize("on_device", [False, True], ids=["kernel", "device-path"])
def test_a_whole_tensor_is_hashed_without_a_per_element_index(monkeypatch, on_device):
    """shards.whole_lanes (what fingerprint and summary take above C) gives the lanes of the
    tensor's whole piece for contiguous, strided, transposed, 0-d, complex and empty tensors,
    and hashing a 4 MiB 1-D tensor allocates no tensor of its size: the whole piece's index
    alone (an int64 per element) would be 8 MiB. The bound: the tensor plus 1 MiB (the device
    path's temporaries, 16 int64 words of a slice, are 512 KiB at 4096-word slices). Control:
    the same bound fails for `lanes` of that whole piece."""
    from titan_audit.audit import device_lanes
    from titan_audit.live_bytes import LiveBytes

    if on_device:  # the device path's torch ops, run on the CPU tensors
        monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
        monkeypatch.setattr(device_lanes, "SLICE_WORDS", 4096)
    cases = [
        torch.randn(64, 48),
        torch.randn(64, 48).t(),
        torch.randn(64, 96)[:, ::2],
        torch.tensor(2.5, dtype=torch.float64),
        torch.randn(5, 7, dtype=torch.complex64),
        torch.empty(0, 3),
    ]
    for t in cases:
        assert shards.whole_lanes(t) == shards.lanes(t, layout.Piece.whole(t.shape)), tuple(t.shape)
    flat = torch.randn(1 << 20)
    with whole_hash_limit(SMALL_C):
        with LiveBytes() as tracker:
            digest = fingerprint(flat)
        assert digest == lattice_digest(flat.dtype, (1 << 20,), shards.lanes(flat, layout.Piece.whole(flat.shape)))
        assert tracker.peak["cpu"] <= flat.nbytes + (1 << 20)
        with LiveBytes() as control:
            shards.lanes(flat, layout.Piece.whole(flat.shape))
        assert control.peak["cpu"] > flat.nbytes + (1 << 20)


def test_a_replicated_tensor_share_is_hashed_without_a_per_element_index():
    """A tensor every rank holds whole (DDP): rank `part` of `parts` hashes the dim-0 rows that
    share_of gives it of the whole piece, and the shares' lanes add up to the whole tensor's, for
    contiguous tensors (no piece built) and strided ones (the piece path). Hashing half of a
    4 MiB 1-D tensor keeps live tensor bytes within the tensor + 1 MiB: the whole piece's index
    alone would be 8 MiB. Control: the same bound fails for share_of of the whole piece."""
    from titan_audit.live_bytes import LiveBytes

    cases = [torch.randn(10, 6), torch.randn(7), torch.randn(64, 96)[:, ::2], torch.randn(5, 3).t(), torch.randn(2, 3)]
    for t in cases:
        whole = layout.Piece.whole(t.shape)
        for parts in (1, 2, 3):
            got = []
            for part in range(parts):
                share = shards.replicated_share(t, part, parts)
                expected = layout.share_of(t, whole, part, parts)
                assert (share is None) == (expected is None), (tuple(t.shape), part, parts)
                if share is not None:
                    got.append(shards.share_lanes(*share))
                    assert got[-1] == shards.lanes(*expected), (tuple(t.shape), part, parts)
            assert lattice.add_lanes(got) == shards.whole_lanes(t), (tuple(t.shape), parts)
    flat = torch.randn(1 << 20)
    with LiveBytes() as tracker:
        shards.share_lanes(*shards.replicated_share(flat, 0, 2))
    assert tracker.peak["cpu"] <= flat.nbytes + (1 << 20)
    with LiveBytes() as control:
        shards.lanes(*layout.share_of(flat, layout.Piece.whole(flat.shape), 0, 2))
    assert control.peak["cpu"] > flat.nbytes + (1 << 20)


def test_a_sharded_piece_keeps_only_its_local_indices():
    """piece_of's piece of a sharded tensor (`_placed`, from placements and a mesh coordinate)
    holds the global indices of the local positions and no more: its index storage is 8 bytes
    per local position of each dim, for Shard, _StridedShard, Replicate and two mesh dims on one
    tensor. Control: the same pieces as views of each dim's whole arange exceed the bound."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def stored(piece):
        return sum(i.untyped_storage().nbytes() for i in piece.index)

    shape = torch.Size([40000, 6])
    cases = [
        ((Shard(0),), (4,), (1,), (torch.arange(10000, 20000), torch.arange(6))),
        ((Shard(1), Replicate()), (3, 2), (2, 1), (torch.arange(40000), torch.arange(4, 6))),
        ((Shard(0), Shard(0)), (2, 4), (1, 3), (torch.arange(35000, 40000), torch.arange(6))),
        ((_StridedShard(0, split_factor=2), Shard(0)), (2, 2), (1, 0), None),
    ]
    for placements, sizes, coord, expected in cases:
        mesh = SimpleNamespace(size=lambda d, sizes=sizes: sizes[d])
        piece = layout._placed(SimpleNamespace(shape=shape, placements=placements), mesh, coord)
        if expected is not None:
            assert all(torch.equal(a, b) for a, b in zip(piece.index, expected)), placements
        assert stored(piece) == 8 * sum(piece.local_shape), placements
        if expected is not None and piece.local_shape[0] < shape[0]:  # runs: a view of arange each
            views = tuple(torch.arange(n)[int(i[0]) :][: len(i)] for n, i in zip(shape, piece.index))
            assert all(torch.equal(a, b) for a, b in zip(views, piece.index))
            assert stored(layout.Piece(tuple(shape), views)) > 8 * sum(piece.local_shape), placements


def test_up_to_c_the_xxh3_fingerprint_is_unchanged_and_c_is_2_mib():
    assert WHOLE_HASH_BYTES == whole_hash_bytes() == 2 << 20
    at_c = torch.randn(2048, 256)  # the tiny goldens' largest record: exactly C bytes
    assert at_c.nbytes == WHOLE_HASH_BYTES
    assert fingerprint(at_c) == whole_digest(at_c)
    above = torch.randn(2048 * 256 + 1)
    assert fingerprint(above) == _documented(above) != whole_digest(above)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        with whole_hash_limit(-1):
            pass


def test_summary_statistics_above_c_are_those_of_the_whole_tensor():
    t = torch.randn(300, 700)
    t[3, 5] = -1e3
    with whole_hash_limit(SMALL_C):
        summary = summarize(t, with_stats=True)
    absmax, mean = stats(t)
    assert (summary.absmax, summary.mean) == (absmax, mean) and summary.absmax == 1e3


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip_bit(t: torch.Tensor, flat: int, bit: int) -> torch.Tensor:
    """A copy of `t` with one bit of element `flat` flipped (through an integer view)."""
    out = t.clone()
    bits = out.view(-1).view(_INT_OF[t.element_size()])
    bits[flat] = bits[flat] ^ (1 << bit) if bit < 8 * t.element_size() - 1 else bits[flat] ^ torch.iinfo(bits.dtype).min
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_control_a_one_element_change_is_always_found(dtype):
    t = _tensor(dtype, (64, 33))
    width = 8 * t.element_size()
    with whole_hash_limit(SMALL_C):
        base = fingerprint(t)
        for flat in (0, 1, 1000, t.numel() - 1):
            for bit in (0, 1, width // 2, width - 2, width - 1):  # lowest mantissa bit ... the sign
                changed = _flip_bit(t, flat, bit)
                assert not torch.equal(changed.view(_INT_OF[t.element_size()]), t.view(_INT_OF[t.element_size()]))
                assert fingerprint(changed) != base, (flat, bit)
        zeros = torch.zeros(4096, dtype=dtype)
        negative = zeros.clone()
        negative[77] = -0.0
        assert fingerprint(zeros) != fingerprint(negative)  # -0.0 != +0.0
        nan = torch.full((4096,), math.nan, dtype=torch.float32)
        payload = nan.clone()
        payload.view(torch.int32)[9] = 0x7FC00001  # another NaN payload
        assert fingerprint(nan) != fingerprint(payload)


def test_control_swapped_elements_and_another_dtype_or_shape_give_other_digests():
    t = torch.randn(128, 64)
    with whole_hash_limit(SMALL_C):
        base = fingerprint(t)
        for i, j in ((0, 1), (5, 4000), (0, t.numel() - 1)):
            swapped = t.clone().view(-1)
            swapped[i], swapped[j] = t.view(-1)[j], t.view(-1)[i]
            assert fingerprint(swapped.view(128, 64)) != base, (i, j)
        assert fingerprint(t.view(64, 128)) != base
        assert fingerprint(t.view(torch.int32)) != base
        rolled = t.roll(1, dims=1)  # every row shifted by one column
        assert fingerprint(rolled) != base


def test_control_two_changes_in_one_block_or_in_two_blocks_are_found():
    """Inside a block the two terms share B (NH's inner sum); across blocks each has its own B."""
    t = torch.randn(128, 96)  # 12288 words: three blocks of 4096
    with whole_hash_limit(SMALL_C):
        base = fingerprint(t)
        for i, j in ((10, 11), (100, 4000), (4095, 4096), (7, 12000)):
            changed = t.clone().view(-1)
            changed.view(torch.int32)[i] += 1  # one ulp up here ...
            changed.view(torch.int32)[j] -= 1  # ... and one down there: the integer sum is unchanged
            assert fingerprint(changed.view(128, 96)) != base, (i, j)
