"""Kernel outputs skip deterministic mode's NaN fill (`cpu/_lib.output`), and only that changes:
the tensor is a plain contiguous CPU tensor of the asked shape and dtype, and a BI op computes the
same bits with it as with a filled `torch.empty` (the kernels write every element). Filled
elements are counted with torch's profiler (the input shapes of `aten::fill_` events; the route
does fill the zero elements of the `torch.empty(0)` it views the storage with)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._debug_mode import DebugMode

from titan_audit import batch_invariant as bi
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.deterministic.switches import enable

LARGE = (256, 1024)  # 1 MB of float32: over UNFILLED_MIN_BYTES


def _fills(make) -> tuple[int, torch.Tensor]:
    """(elements written by aten::fill_ while `make` ran, what it made)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        made = make()
    return sum(math.prod(e.input_shapes[0]) for e in prof.events() if e.name == "aten::fill_"), made


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_large_output_is_not_filled_and_the_count_can_see_a_fill(dtype):
    with enable(0):
        fills, out = _fills(lambda: _lib.output(LARGE, dtype))
        control_fills, control = _fills(lambda: torch.empty(LARGE, dtype=dtype))
    assert fills == 0
    assert control_fills == control.numel() and bool(control.isnan().all())  # negative control: torch.empty fills
    assert out.shape == LARGE and out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
    assert out.stride() == control.stride() and out.untyped_storage().nbytes() == control.untyped_storage().nbytes()


def test_small_outputs_outputs_under_a_dispatch_mode_and_outside_deterministic_mode_take_torch_empty():
    assert _lib.output((3, 0), torch.float32).shape == (3, 0)
    with enable(0):
        fills, small = _fills(lambda: _lib.output((4, 8), torch.float32))
        with DebugMode():  # what the op log records under: every op's outputs are hashed on return
            fills_watched, watched = _fills(lambda: _lib.output(LARGE, torch.float32))
    assert fills == small.numel() and bool(small.isnan().all())
    assert fills_watched == watched.numel() and bool(watched.isnan().all())
    fills, _ = _fills(lambda: _lib.output(LARGE, torch.float32))
    assert fills == 0


def test_bi_ops_give_the_same_bits_in_unfilled_outputs():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(300, 512, generator=gen), torch.randn(512, 384, generator=gen)
    w = torch.randn(512, generator=gen)

    def run():
        return bi.mm(a, b), bi.rms_norm(a, w, 1e-6), bi.softmax(a, -1)

    with enable(0):
        unfilled = run()
        original = _lib.UNFILLED_MIN_BYTES
        _lib.UNFILLED_MIN_BYTES = 1 << 62  # every output through torch.empty, NaN-filled
        try:
            filled = run()
        finally:
            _lib.UNFILLED_MIN_BYTES = original
    for x, y in zip(unfilled, filled, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
