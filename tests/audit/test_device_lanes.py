"""device_lanes: the lattice lanes a GPU rank's piece takes, in torch integer ops and in the Triton
kernel (batch_invariant/gpu/lattice.py), are the CPU kernel's integers, run here on CPU tensors
(the same torch ops; the Triton kernel in Triton's interpreter, marker `triton`) and on CUDA by
scripts/gpu_check.sh (marker `gpu`). Negative controls: one word changed, two elements swapped,
and the same words at other global indices give other lanes."""

import importlib.util
import warnings

import pytest
import torch

from titan_audit.audit import device_lanes, shards
from titan_audit.audit.pieces import Piece
from titan_audit.batch_invariant.cpu import lattice


@pytest.fixture(params=["torch", pytest.param("triton", marks=pytest.mark.triton)])
def path(request, monkeypatch) -> str:
    """Which device path `device_lanes.row_lanes` takes for the test's (CPU) words."""
    if request.param == "triton":
        pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    monkeypatch.setattr(device_lanes, "_use_triton", lambda words: request.param == "triton")
    return request.param


def _both(local: torch.Tensor, piece: Piece, positions=None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the CPU kernel's lanes, the device path's lanes) of the same elements."""
    return shards.lanes(local, piece, positions), device_lanes.row_lanes(*shards.word_rows(local, piece, positions))


def _random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 1e3).to(dtype)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool, torch.float64, torch.int64],
    ids=str,
)
def test_whole_tensor_lanes_are_the_kernels_in_every_word_width(dtype, path):
    t = _random((3, 2 * lattice.BLOCK + 77), dtype, 1)  # rows cross block boundaries
    kernel, ops = _both(t, Piece.whole(t.shape))
    assert ops == kernel
    assert lattice.version() == device_lanes.VERSION


def test_complex_and_0d(path):
    z = torch.randn(5, 7, dtype=torch.complex64)
    assert _both(z, Piece.whole(z.shape))[1] == _both(z, Piece.whole(z.shape))[0]
    s = torch.tensor(3.5)
    assert device_lanes.row_lanes(*shards.word_rows(s, Piece.whole(()))) == shards.lanes(s, Piece.whole(()))


def test_pieces_positions_and_strided_views(monkeypatch, path):
    """A column shard (rows of a few words at scattered global indices), a subset of positions,
    and a transposed view, with slices of 1000 words so that several slices run (short rows) and
    a long row is cut into slices."""
    monkeypatch.setattr(device_lanes, "SLICE_WORDS", 1000)
    full = _random((40, 3000), torch.float32, 2)
    cols = torch.arange(1000, 1700)
    piece = Piece(tuple(full.shape), (torch.arange(40), cols))
    local = full[:, 1000:1700].clone()
    kernel, ops = _both(local, piece)
    assert ops == kernel
    positions = (torch.tensor([0, 3, 4, 39]), torch.arange(5, 600))
    kernel, ops = _both(local, piece, positions)
    assert ops == kernel
    view = full.t()  # strides (1, 3000): the last dimension is not contiguous
    kernel, ops = _both(view, Piece.whole(view.shape))
    assert ops == kernel
    long_rows = _random((2, 4500), torch.bfloat16, 3)  # each row longer than a slice
    kernel, ops = _both(long_rows, Piece.whole(long_rows.shape))
    assert ops == kernel


def test_word_indices_past_two_to_the_32(path):
    """Three rows of a logical [2^21 + 8, 2^12] float32 tensor (2^33 words): the global indices
    and block numbers are past 2^32 (what a 70B model's embedding reaches)."""
    shape = ((1 << 21) + 8, 1 << 12)
    rows = torch.tensor([(1 << 20) + 1, (1 << 21) + 3, (1 << 21) + 7])
    piece = Piece(shape, (rows, torch.arange(shape[1])))
    local = _random((3, shape[1]), torch.float32, 4)
    kernel, ops = _both(local, piece)
    assert ops == kernel


@pytest.mark.control
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_controls_one_word_a_swap_and_another_index_move_the_lanes(dtype, path):
    """Marked `control`, so it also runs under every forced ATen capability and kernel variant
    (tests/test_controls_under_variants.py): the device path's lanes equal the CPU kernel's there too
    (ATen's int64 vector code differs by capability), and each constructed difference moves both
    lanes: one bit of one word, two swapped elements, the same words one row later."""
    t = _random((4, 5000), dtype, 5)
    piece = Piece.whole(t.shape)
    base = device_lanes.row_lanes(*shards.word_rows(t, piece))
    assert base == shards.lanes(t, piece)
    changed = t.clone()
    changed.view(torch.uint8)[2, 4097 * t.element_size()] ^= 1 << 7  # one bit of one word
    swapped = t.clone()
    swapped[1, 10], swapped[1, 11] = t[1, 11].clone(), t[1, 10].clone()
    assert not torch.equal(swapped, t)
    moved = Piece((5, 5000), (torch.arange(1, 5), torch.arange(5000)))  # the same words one row later
    for local, where in ((changed, piece), (swapped, piece), (t, moved)):
        other = device_lanes.row_lanes(*shards.word_rows(local, where))
        assert other == shards.lanes(local, where)
        assert all(a != b for a, b in zip(other, base))  # both lanes move


@pytest.mark.triton
def test_a_triton_kernel_that_cannot_run_leaves_the_lanes_to_the_torch_ops(monkeypatch):
    """Where the Triton kernel cannot be compiled or launched (a launch made to raise here, as on
    a GPU or Triton build it does not support), row_lanes warns once for the device and the torch
    ops give the lanes, the CPU kernel's; later calls do not try the kernel again. Any other
    error (a bug of ours) is raised."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    from titan_audit.batch_invariant.gpu import lattice as triton_lattice

    calls = []

    def fails(*args):
        calls.append(args)
        raise RuntimeError("PTXAS error: Value 'sm_60' is not defined for option 'gpu-name'")

    monkeypatch.setattr(triton_lattice, "lanes_on_device", fails)
    monkeypatch.setattr(device_lanes, "_use_triton", lambda words: True)
    monkeypatch.setattr(device_lanes, "_triton_failed", {})
    t = _random((3, 5000), torch.float32, 11)
    piece = Piece.whole(t.shape)
    with pytest.warns(RuntimeWarning, match="cannot run on cpu .*PTXAS error"):
        assert device_lanes.row_lanes(*shards.word_rows(t, piece)) == shards.lanes(t, piece)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device_lanes.row_lanes(*shards.word_rows(t, piece)) == shards.lanes(t, piece)
    assert len(calls) == 1

    def has_a_bug(*args):
        raise AssertionError("a bug")

    monkeypatch.setattr(device_lanes, "_triton_failed", {})
    monkeypatch.setattr(triton_lattice, "lanes_on_device", has_a_bug)
    with pytest.raises(AssertionError, match="a bug"):
        device_lanes.row_lanes(*shards.word_rows(t, piece))


def test_refuses_other_versions_and_word_types():
    t = torch.randn(10)
    with lattice.using_version(1), pytest.raises(ValueError, match="version 2"):
        device_lanes.row_lanes(*shards.word_rows(t, Piece.whole(t.shape)))
    with pytest.raises(ValueError, match="words must be one of"):
        device_lanes.row_lanes(t, 10, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_fingerprint_and_summary_through_the_device_path_are_the_cpu_ones(monkeypatch):
    """With every tensor routed to the device path (as a GPU tensor is), a tensor above C has
    the fingerprint and summary hash of the CPU kernel, and the same absmax; the mean is the
    device's float64 sum (informational: close, not compared). Control: one element moved by one
    ulp changes the device path's hash."""
    from titan_audit.audit import summary
    from titan_audit.audit.fingerprint import fingerprint, whole_hash_limit

    t = _random((300, 1000), torch.float32, 6)
    with whole_hash_limit(1024):
        expected_hash, expected = fingerprint(t), summary.summarize(t)
        monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
        assert fingerprint(t) == expected_hash
        got = summary._summarize_on_device(t, True)
        assert (got.dtype, got.shape, got.hash, got.absmax) == expected[:4]
        assert got.mean == pytest.approx(expected.mean, rel=1e-6)  # float32 lanes per block vs float64
        nudged = t.clone()
        nudged[123, 456] = torch.nextafter(nudged[123, 456], torch.tensor(float("inf")))
        assert summary._summarize_on_device(nudged, False).hash != got.hash
        assert fingerprint(nudged) != expected_hash


def test_device_statistics_of_every_dtype_class(monkeypatch):
    from titan_audit.audit import summary

    monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
    assert summary.absmax_sum(torch.tensor([1.5, -2.25, 0.0], dtype=torch.float16)) == (2.25, -0.75)
    assert summary.absmax_sum(torch.tensor([-128, 3, 2], dtype=torch.int8)) == (128.0, -123.0)
    assert summary.absmax_sum(torch.tensor([True, False, True])) == (1.0, 2.0)
    absmax, total = summary.absmax_sum(torch.tensor([1.0, float("nan"), -3.0]))
    assert absmax != absmax and total != total  # NaN propagated
    assert summary.absmax_sum(torch.tensor([1.0, float("-inf")])) == (float("inf"), float("-inf"))


def test_device_statistics_read_half_precision_in_place(monkeypatch):
    """A float16 piece's device statistics (aminmax and a float64 sum, read as it is) allocate
    nothing of its size: peak live bytes within the piece + 64 KiB; absmax exact, the sum the
    float64 one. Control: widening it to float32 first (what float8 needs) exceeds the bound."""
    from titan_audit.audit import summary
    from titan_audit.live_bytes import LiveBytes

    monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
    t = _random((1 << 20,), torch.float16, 12)
    with LiveBytes() as tracker:
        absmax, total = summary.absmax_sum(t)
    assert tracker.peak["cpu"] <= t.nbytes + (1 << 16)
    assert absmax == float(t.float().abs().max())
    assert total == pytest.approx(float(t.double().sum()), rel=1e-12)
    with LiveBytes() as control:
        summary.absmax_sum(t.float())
    assert control.peak["cpu"] > t.nbytes + (1 << 16)


@pytest.mark.gpu
def test_on_cuda_the_lanes_summary_and_fingerprint_are_the_cpu_ones(monkeypatch):
    """On a GPU: a CUDA tensor above C (whole, a column piece, a bfloat16 one) gets the CPU
    kernel's lanes, fingerprint and summary hash with no host copy of it, through the Triton
    kernel and through the torch ops alike. Control: one element changed on the device changes
    the fingerprint."""
    from titan_audit.audit import summary
    from titan_audit.audit.fingerprint import fingerprint, whole_hash_limit

    t = _random((257, 3 * lattice.BLOCK + 5), torch.float32, 7)
    dev = t.cuda()
    piece = Piece(tuple(t.shape), (torch.arange(257), torch.arange(100, 5000)))
    b = t.bfloat16()
    expected = [shards.lanes(t[:, 100:5000].contiguous(), piece), shards.lanes(b, Piece.whole(b.shape))]
    assert device_lanes._use_triton(dev) == (importlib.util.find_spec("triton") is not None)
    for triton in (True, False):
        monkeypatch.setattr(device_lanes, "_use_triton", lambda words, triton=triton: triton)
        got = [shards.lanes(dev[:, 100:5000], piece), shards.lanes(b.cuda(), Piece.whole(b.shape))]
        assert got == expected, f"triton={triton}"
    monkeypatch.undo()
    with whole_hash_limit(1024):
        assert fingerprint(dev) == fingerprint(t)
        on_gpu, on_cpu = summary.summarize(dev), summary.summarize(t)
        assert on_gpu[:4] == on_cpu[:4]
        dev[3, 4] += 1
        assert fingerprint(dev) != fingerprint(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128, torch.bool, torch.bfloat16], ids=str)
def test_row_blocks_through_shards_lanes_are_the_kernels(monkeypatch, dtype, path):
    """shards.lanes routes a piece of whole dim-0 rows (a whole tensor, an FSDP2 shard) on a
    device as one row of words with no index tables: the CPU kernel's lanes for every word
    width, and for a 0-d tensor."""
    t = _random((10, 1000), dtype, 8)
    pieces = [(t, Piece.whole(t.shape)), (t[3:7], Piece(tuple(t.shape), (torch.arange(3, 7), torch.arange(1000))))]
    expected = [shards.lanes(local, piece) for local, piece in pieces]
    s = torch.tensor(2.5, dtype=torch.float64)
    expected_0d = shards.lanes(s, Piece.whole(()))
    monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
    assert [shards.lanes(local, piece) for local, piece in pieces] == expected
    assert shards.lanes(s, Piece.whole(())) == expected_0d


def test_device_path_temporaries_are_bounded_by_the_slice_not_the_tensor(monkeypatch):
    """Live tensor bytes while a 4 MB tensor (a whole one, then a column piece) is hashed through
    the device path with slices of 4096 words: at most what exists already (the tensor and its
    piece's index tensors, counted once an op reads them) plus 16 int64 temporaries of a slice
    (512 KiB), i.e. nothing of the tensor's size is allocated."""
    from titan_audit.live_bytes import LiveBytes

    monkeypatch.setattr(device_lanes, "SLICE_WORDS", 4096)
    monkeypatch.setattr(shards, "hashed_on_device", lambda local: True)
    t = _random((1 << 20,), torch.float32, 9)
    column = _random((1024, 1024), torch.float32, 10)
    cases = [
        (t, Piece.whole(t.shape)),
        (column[:, 100:900], Piece((1024, 1024), (torch.arange(1024), torch.arange(100, 900)))),
    ]
    for local, piece in cases:
        with LiveBytes() as tracker:
            shards.lanes(local, piece)
        existing = local.untyped_storage().nbytes() + sum(i.untyped_storage().nbytes() for i in piece.index)
        assert tracker.peak["cpu"] <= existing + 16 * 8 * 4096
