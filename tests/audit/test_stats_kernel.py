"""The audit's statistics kernel (batch_invariant/cpu/stats.py, kernels/stats.cpp): absmax + sum in
the documented fixed order, bitwise, on every ISA variant this CPU runs; fed in pieces of whole
blocks it gives the bits of one call; the battery golden pins it on every CPU.

Negative controls: another summation order (a sequential float64 sum, float64 lanes without float32
blocks, another block size, a piece that is not a whole block) gives other bits on the same data, and a golden with one
absmax_sum hash flipped fails, naming the case.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu import stats as K
from titan_audit.portability import kernel_golden

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
LENGTHS = [1, 5, 31, 32, 33, 1023, 1024, 1025, 3000, 5003]


def _tree(lanes: np.ndarray) -> float:
    s = lanes[:16] + lanes[16:]
    while s.size > 1:  # tree16: l[i] + l[i + 8], then + 4, + 2, + 1
        s = s[: s.size // 2] + s[s.size // 2 :]
    return float(s[0])


def reference(t: torch.Tensor, block: int = K.BLOCK, float32_lanes: bool = True) -> tuple[float, float]:
    """The order of kernels/stats.cpp, re-derived in numpy (every add an IEEE add of one format)."""
    x = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    lanes = np.full(K.LANES, -0.0)
    if t.dtype == torch.float64 or not float32_lanes:
        # element i into float64 lane i % 32, ascending: one column of a [n/32, 32] array each
        pad = (-x.size) % K.LANES
        cols = np.concatenate([x.astype(np.float64), np.full(pad, -0.0)]).reshape(-1, K.LANES)
        for row in cols:
            lanes = lanes + row
    else:
        for b in range(0, x.size, block):
            blk = x[b : b + block]
            pad = (-blk.size) % K.LANES
            rows = np.concatenate([blk, np.full(pad, -0.0, np.float32)]).reshape(-1, K.LANES)
            fl = np.full(K.LANES, -0.0, np.float32)
            for row in rows:
                fl = fl + row  # float32 adds, lane by lane
            lanes = lanes + fl.astype(np.float64)
    absmax = math.nan if np.isnan(x).any() else (float(np.abs(x).max()) if x.size else 0.0)
    total = _tree(lanes)
    return absmax, (math.nan if math.isnan(total) else total)


def _data(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g, dtype=torch.float64) * 4
    t[:: max(1, n // 7)] *= 1e5  # a wide range: the order shows in the low bits
    return t.to(dtype)


def _bits(pair: tuple[float, float]) -> bytes:
    return np.array(pair, dtype=np.float64).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant_gives_the_documented_order_bitwise(dtype: torch.dtype) -> None:
    for n in LENGTHS:
        t = _data(dtype, n, seed=n)
        want = _bits(reference(t))
        for isa in _lib.available_isas():
            with _lib.forced_isa(isa):
                assert _bits(K.absmax_sum(t)) == want, (dtype, n, isa)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pieces_of_whole_blocks_give_the_bits_of_one_call(dtype: torch.dtype) -> None:
    t = _data(dtype, 5 * K.BLOCK + 17, seed=1)
    state = K.new_state()
    item = t.element_size()
    for start, count in ((0, K.BLOCK), (K.BLOCK, 3 * K.BLOCK), (4 * K.BLOCK, K.BLOCK + 17)):
        K.update(state, dtype, t.data_ptr() + start * item, count)
    assert _bits(K.result(state)) == _bits(K.absmax_sum(t))


@pytest.mark.control
def test_negative_controls_other_orders_give_other_bits() -> None:
    t = _data(torch.float32, 5 * K.BLOCK + 17, seed=1)
    got = _bits(K.absmax_sum(t))
    assert _bits(reference(t, float32_lanes=False)) != got, "float64 lanes without float32 blocks"
    assert _bits(reference(t, block=K.BLOCK * 2)) != got, "another block size"
    sequential = -0.0
    for v in t.double().tolist():  # one float64 add after another, ascending
        sequential += v
    assert _bits((float(t.abs().max()), sequential)) != got, "a sequential float64 sum"
    # a first piece that is not a whole block moves every later element to another block
    state = K.new_state()
    K.update(state, torch.float32, t.data_ptr(), 1000)
    K.update(state, torch.float32, t.data_ptr() + 4000, t.numel() - 1000)
    assert _bits(K.result(state)) != got


@pytest.mark.parametrize("dtype", DTYPES)
def test_specials(dtype: torch.dtype) -> None:
    zeros = torch.full((2049,), -0.0, dtype=dtype)
    absmax, total = K.absmax_sum(zeros)
    assert absmax == 0.0 and math.copysign(1.0, absmax) == 1.0 and math.copysign(1.0, total) == -1.0
    t = torch.ones(100, dtype=dtype)
    t[7], t[50] = -math.inf, math.inf
    absmax, total = K.absmax_sum(t)  # inf - inf: an invalid add, NaN
    assert absmax == math.inf and math.isnan(total)
    t[7] = math.nan
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            state = K.new_state()
            K.update(state, dtype, t.data_ptr(), t.numel())
            raw = np.frombuffer(bytes(state), np.uint64)
            nans = raw[np.isnan(raw.view(np.float64))]
            assert nans.size >= 2 and (nans == 0x7FF8000000000000).all(), "one canonical quiet NaN"
    assert K.absmax_sum(torch.tensor([-3.0, 2.5])) == (3.0, -0.5)


def test_the_battery_golden_pins_the_kernel_and_a_flipped_hash_fails(tmp_path: Path) -> None:
    golden = kernel_golden.load(kernel_golden.DEFAULT_PATH)
    families = {key.split("/")[0] for key in golden["kernels"]["cases"]}
    assert {"absmax_sum_f32", "absmax_sum_bf16", "absmax_sum_f64"} <= families
    result = kernel_golden.check(kernel_golden.DEFAULT_PATH, section="kernels", only="absmax_sum_")
    r = result["sections"]["kernels"]
    assert result["passed"] and r["cases"] > 0 and r["mismatch_count"] == 0, kernel_golden.check_report(result)
    # negative control: one case's hash flipped
    key = "absmax_sum_f32/uniform_1025"
    old = golden["kernels"]["cases"][key]["hash"]
    golden["kernels"]["cases"][key]["hash"] = ("0" if old[0] != "0" else "1") + old[1:]
    flipped = tmp_path / "kernels.json"
    flipped.write_text(json.dumps(golden))
    bad = kernel_golden.check(flipped, section="kernels", only="absmax_sum_f32/uniform_1025")
    assert not bad["passed"]
    assert {(m["kernel"], m["case"]) for m in bad["sections"]["kernels"]["mismatches"]} == {
        ("absmax_sum_f32", "uniform_1025")
    }
