"""summarize: its hash is audit.fingerprint of the logical tensor for every layout and dtype."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from titan_audit.audit import fingerprint
from titan_audit.audit.summary import stats, summarize

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hash_is_the_fingerprint_of_the_logical_tensor(dtype, shape, transpose, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 10).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    s = summarize(t)
    assert s.hash == fingerprint(t.contiguous())
    assert (s.dtype, s.shape) == (str(dtype).removeprefix("torch."), str(list(t.shape)))
    if t.numel():
        wide = t.double()
        assert s.absmax == float(wide.abs().max())
        assert s.mean == pytest.approx(float(wide.mean()), rel=1e-5, abs=1e-5)
    else:
        assert math.isnan(s.absmax) and math.isnan(s.mean)


def test_requires_grad_and_views_are_read_without_autograd():
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2
    s = summarize(y[:, 1])
    assert s.hash == fingerprint(y.detach()[:, 1].contiguous())
    assert summarize(y, with_stats=False).absmax is None


def test_stats_inf_and_nan():
    assert stats(torch.tensor([1.0, -math.inf])) == (math.inf, -math.inf)
    absmax, mean = stats(torch.tensor([math.nan, 1.0]).bfloat16())
    assert math.isnan(absmax) and math.isnan(mean)


@pytest.mark.control  # also under every forced kernel variant (tests/test_controls_under_variants.py)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_hash_and_stats_run_at_once_are_the_separate_values(dtype, threads):
    """At most C bytes the hash and the statistics kernel run in one call, on two threads when
    there are two and the tensor is large enough: the hash is still `fingerprint`'s and the
    statistics the kernel's own bits, below and above the size that takes two threads. Negative
    controls: the last element's lowest bit flipped changes the hash; the largest element
    doubled changes absmax (both read the bytes given)."""
    from titan_audit.batch_invariant.cpu import stats as kernel

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for numel in (5, 3 * kernel.BLOCK + 7, (1 << 18) // dtype.itemsize + 3):
            t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 100).to(dtype)
            s = summarize(t)
            absmax, total = kernel.absmax_sum(t)
            assert s.hash == fingerprint(t)
            assert (s.absmax, s.mean) == (absmax, total / t.numel())
            assert s.absmax == float(t.double().abs().max())
            flipped = t.clone()
            flipped.view(-1)[-1:].view(torch.uint8)[0] ^= 1  # lowest byte of the last element, little-endian
            assert summarize(flipped).hash == fingerprint(flipped) != s.hash
            doubled = t.clone()
            doubled[t.abs().argmax()] *= 2
            assert summarize(doubled).absmax == 2 * s.absmax
            assert summarize(t, with_stats=False) == (s.dtype, s.shape, s.hash, None, None)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_lattice_hash_and_stats_read_piece_by_piece_on_threads_are_the_one_pass_values(monkeypatch, threads):
    """Above C the lattice lanes of each piece run on every intra-op thread and the stats kernel
    follows piece by piece (one lattice chunk per thread): the hash is `fingerprint`'s and the
    statistics the kernel's one-call bits at 1 and 2 threads. Negative control: one element of
    the middle piece perturbed by one ulp changes the hash."""
    from titan_audit.audit import summary as summary_module
    from titan_audit.audit.fingerprint import whole_hash_limit
    from titan_audit.batch_invariant.cpu import stats as kernel

    monkeypatch.setattr(summary_module, "_LATTICE_CHUNK_BYTES", 8 * kernel.BLOCK)
    t = torch.randn(7, 3 * kernel.BLOCK + 5, generator=torch.Generator().manual_seed(4)) * 10
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with whole_hash_limit(1024):
            assert t.nbytes > 3 * threads * summary_module._LATTICE_CHUNK_BYTES
            s = summarize(t)
            absmax, total = kernel.absmax_sum(t)
            assert s.hash == fingerprint(t)
            assert (s.absmax, s.mean) == (absmax, total / t.numel())
            perturbed = t.clone()
            middle = perturbed.view(-1)[t.numel() // 2 : t.numel() // 2 + 1]
            middle.copy_(torch.nextafter(middle, middle + 1))
            assert summarize(perturbed).hash == fingerprint(perturbed) != s.hash
    finally:
        torch.set_num_threads(previous)


def test_stats_of_every_dtype_class():
    # float16 and float8 are widened exactly; integers and bools take the exact integer path
    h = torch.tensor([1.5, -2.25, 0.0], dtype=torch.float16)
    assert stats(h) == (2.25, -0.75 / 3)
    assert stats(torch.tensor([True, False, True, True])) == (1.0, 0.75)
    assert stats(torch.tensor([-7, 3, 2], dtype=torch.int16)) == (7.0, -2 / 3)
    assert all(math.isnan(v) for v in stats(torch.tensor([1 + 2j])))
    # negative control: one element changed, the exact comparisons above fail
    assert stats(torch.tensor([1.5, -2.5, 0.0], dtype=torch.float16)) != (2.25, -0.75 / 3)
    assert stats(torch.tensor([-7, 3, 3], dtype=torch.int16)) != (7.0, -2 / 3)
