"""The committed kernel golden (tests/golden/kernels.json) on this CPU, and its negative controls.

Proves: every kernel of every ISA variant this CPU can run, at 1 and 2 threads, reproduces the
golden's hash for every battery case (inputs made from integers, so the golden is the same test on
every CPU), and so do the BI-mode torch ops; the golden's sqrt hash is the hash of the correctly
rounded float32 sqrt (float32(sqrt(float64 x))), so it pins IEEE's result, not one CPU's.
Negative controls: (a) a sqrt with one more rounding (x / sqrt(x), an IEEE division of the
correctly rounded root) is off by an ulp on some of the battery's 2^17 hard sqrt inputs, so its
hash differs from the golden's; (b) a golden with one hash flipped fails the check, naming the
case. torch's own torch.sqrt (MKL VML outside BI mode, its code path picked by the CPU vendor) is
reported, not asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_audit.batch_invariant import enabled
from titan_audit.batch_invariant.cpu import _lib, pointwise
from titan_audit.portability import battery, kernel_golden, torch_ops

GOLDEN = kernel_golden.DEFAULT_PATH


@pytest.fixture(scope="module")
def kernels_result() -> dict:
    return kernel_golden.check(GOLDEN, section="kernels")


def _explain(result: dict) -> str:
    return "\n".join(kernel_golden.check_report(result))


def test_the_kernel_section_passes_exact_on_every_variant_and_thread_count(kernels_result: dict) -> None:
    r = kernels_result["sections"]["kernels"]
    assert kernels_result["passed"], _explain(kernels_result)
    assert r["variants"] == list(_lib.available_isas()), "every variant this CPU can run was checked"
    assert r["threads"] == [1, 2]
    golden = kernel_golden.load(GOLDEN)
    assert r["cases"] == len(golden["kernels"]["cases"]) and r["mismatch_count"] == 0
    assert r["kernels_version"] == {"golden": _lib.KERNELS_VERSION, "here": _lib.KERNELS_VERSION}
    # every exported kernel family is in the battery
    kernels = {key.split("/")[0] for key in golden["kernels"]["cases"]}
    for name in (
        "gemm_f32",
        "gemm_f64",
        "attention_fwd_f32",
        "attention_bwd_f64",
        "row_sum_f32",
        "row_sum_sq_f64",
        "col_sum_f32",
        "softmax_f64",
        "log_softmax_backward_f32",
        "rms_norm_backward_f64",
        "rms_norm_scaled_backward_f32",
        "add_rms_norm_f64",
        "exp_f32",
        "exp2_f32",
        "log_f32",
        "sqrt_f32",
        "sigmoid_f32",
        "silu_backward_f32",
        "silu_mul_f32",
        "silu_mul_backward_f32",
        "exp_f64",
        "log_f64",
        "sqrt_f64",
        "normal_from_bits",
        "cos_sin_f32",
        "rope_inv_freq_f32",
        "embedding_backward_f32",
        "adamw_step_f32",
        "info",
    ):
        assert name in kernels, name


def test_the_torch_ops_section_passes_exact_in_bi_mode() -> None:
    result = kernel_golden.check(GOLDEN, section="torch-ops")
    assert result["passed"], _explain(result)
    r = result["sections"]["torch_ops"]
    assert r["variants"] == list(_lib.available_isas()) and r["threads"] == [1, 2]
    assert r["cases"] == len(kernel_golden.load(GOLDEN)["torch_ops"]["cases"])


def _sqrt_sweep() -> tuple[dict, np.ndarray, np.ndarray]:
    """(the golden's sqrt_f32/sweep case, the battery's inputs, their correctly rounded roots)."""
    want = kernel_golden.load(GOLDEN)["kernels"]["cases"]["sqrt_f32/sweep"]
    x = torch_ops.sqrt_sweep32("sqrt_f32/sweep")  # the battery's generator, in numpy
    assert x.size == want["count"] == 1 << 17
    return want, x, np.sqrt(x.astype(np.float64)).astype(np.float32)  # correctly rounded (53 >= 2 * 24 + 2)


def test_the_golden_sqrt_is_the_correctly_rounded_sqrt() -> None:
    """The golden's sqrt_f32/sweep hash is IEEE's correctly rounded sqrt of the battery's inputs
    (rebuilt here from the same integers); ours equals it on every variant and thread count."""
    want, x, reference = _sqrt_sweep()
    assert battery.digest(reference.tobytes()) == want["hash"], "the golden pins the correctly rounded sqrt"
    (case,) = battery.run_cases(only="sqrt_f32/sweep")
    for rec in case.records:
        assert rec.digest == want["hash"], (rec.variant, rec.threads)
        assert np.array_equal(np.frombuffer(rec.data, np.uint32), reference.view(np.uint32))
    assert np.array_equal(pointwise.sqrt(torch.from_numpy(x)).numpy().view(np.uint32), reference.view(np.uint32))


@pytest.mark.control
def test_negative_control_a_sqrt_with_one_more_rounding_is_not_the_golden_sqrt() -> None:
    """The golden check can fail: x / sqrt(x) (the correctly rounded root, then one IEEE division:
    a root rounded twice) is off by an ulp on some hard inputs, so its hash is not the golden's.
    torch's own sqrt is reported, not asserted: whether MKL's VML rounds these correctly depends on
    the CPU."""
    want, x, reference = _sqrt_sweep()
    other = x / reference
    off = np.flatnonzero(other.view(np.uint32) != reference.view(np.uint32))
    assert off.size > 0, "x / sqrt(x) was the correctly rounded root on every hard input: the control cannot fail"
    assert battery.digest(other.tobytes()) != want["hash"]
    ulps = np.abs(other.view(np.int32)[off].astype(np.int64) - reference.view(np.int32)[off].astype(np.int64))
    assert ulps.max() <= 1, f"x={x[off[0]]!r}: {other[off[0]]!r}, correctly rounded {reference[off[0]]!r}"
    with enabled(False):
        native = torch.sqrt(torch.from_numpy(x)).numpy()
    native_off = int((native.view(np.uint32) != reference.view(np.uint32)).sum())
    print(f"torch.sqrt: {native_off} of {x.size} roots not correctly rounded")


def test_negative_control_a_flipped_hash_fails_naming_the_case(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    key = "exp_f32/bits_7"
    old = golden["kernels"]["cases"][key]["hash"]
    golden["kernels"]["cases"][key]["hash"] = ("0" if old[0] != "0" else "1") + old[1:]
    flipped = tmp_path / "kernels.json"
    flipped.write_text(json.dumps(golden))
    result = kernel_golden.check(flipped, section="kernels", only="exp_f32/bits")
    assert not result["passed"]
    r = result["sections"]["kernels"]
    assert {m["case"] for m in r["mismatches"]} == {"bits_7"} and {m["kernel"] for m in r["mismatches"]} == {"exp_f32"}
    assert r["mismatch_count"] == len(_lib.available_isas()) * 2  # every variant, threads 1 and 2
    assert "exp_f32/bits_7" in _explain(result)
    # a case the golden does not know, and one it has that did not run, are differences too
    del golden["kernels"]["cases"]["exp_f32/bits_1"]
    golden["kernels"]["cases"]["exp_f32/bits_99"] = {"hash": old, "dtype": "f32", "count": 99}
    flipped.write_text(json.dumps(golden))
    r = kernel_golden.check(flipped, section="kernels", only="exp_f32/bits")["sections"]["kernels"]
    assert r["unexpected"] == ["exp_f32/bits_1"] and r["missing"] == ["exp_f32/bits_99"] and not r["passed"]


def test_a_differing_variant_is_named_with_its_first_differing_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record that differs while another record here has the golden's bits is reported with its
    first differing element and both values (the battery's real output, one record altered in
    flight: this tests the report, the kernels are tested above)."""
    real = kernel_golden._cases

    def altered(section: str, arch: str, only: str | None):  # noqa: ANN202
        for case in real(section, arch, only):
            rec = case.records[-1]  # the widest variant, threads 2
            bits = bytearray(rec.data)
            bits[12:16] = np.array([0x7FC00000], "<u4").tobytes()  # element 3 := NaN
            rec.data, rec.digest = bytes(bits), battery.digest(bytes(bits))
            yield case

    monkeypatch.setattr(kernel_golden, "_cases", altered)
    result = kernel_golden.check(GOLDEN, section="kernels", only="exp_f32/range_4097")
    (m,) = result["sections"]["kernels"]["mismatches"]
    assert (m["kernel"], m["case"], m["variant"], m["threads"]) == (
        "exp_f32",
        "range_4097",
        _lib.available_isas()[-1],
        2,
    )
    d = m["first_difference"]
    assert d["index"] == 3 and d["got"] == "nan" and d["got_bits"] == "0x7fc00000" and d["expected"] != "nan"
    assert "scalar, threads 1" in m["note"]
    text = _explain(result)
    assert "first differing element 3" in text and "exp_f32/range_4097" in text
