"""The numerics fingerprint: what it records, its round trip, and why two differ."""

import dataclasses

import pytest
import torch

from titan_audit import deterministic
from titan_audit.deterministic import NumericsFingerprint, incompatibilities
from titan_audit.deterministic.numerics import FINGERPRINT_VERSION


def test_fingerprint_records_the_numerics_that_matter():
    fp = deterministic.fingerprint("cpu")
    assert fp.torch_version == torch.__version__
    assert fp.device_kind == "cpu" and fp.device_name
    assert fp.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert fp.num_threads == torch.get_num_threads()
    assert fp.blas and fp.default_dtype == "float32"
    assert "CUBLAS_WORKSPACE_CONFIG" in fp.env and "MKL_CBWR" in fp.env
    assert fp.batch_invariant is False


def test_round_trip_through_dict_is_compatible_with_itself():
    fp = deterministic.fingerprint("cpu")
    again = NumericsFingerprint.from_dict(fp.to_dict())
    assert again == fp
    assert incompatibilities(fp, again) == []
    assert deterministic.compatible(fp, again)


def test_incompatibilities_name_each_differing_field():
    fp = deterministic.fingerprint("cpu")
    other = dataclasses.replace(
        fp, torch_version="0.0.1", num_threads=fp.num_threads + 3, env={**fp.env, "MKL_CBWR": "COMPATIBLE"}
    )
    reasons = incompatibilities(fp, other)
    assert len(reasons) == 3
    assert any(r.startswith("torch_version") for r in reasons)
    assert any(r.startswith("num_threads") for r in reasons)
    assert any("MKL_CBWR" in r for r in reasons)


def test_informational_fields_do_not_break_compatibility():
    fp = deterministic.fingerprint("cpu")
    other = dataclasses.replace(fp, info={**fp.info, "python": "9.9", "env": {"OMP_NUM_THREADS": "1"}})
    assert incompatibilities(fp, other) == []


def test_deterministic_mode_and_thread_count_show_in_the_fingerprint():
    plain = deterministic.fingerprint("cpu")
    with deterministic.enable(0, threads=1):
        det = deterministic.fingerprint("cpu")
    assert det.deterministic_algorithms and det.num_threads == 1
    if plain.num_threads != 1 or not plain.deterministic_algorithms:
        assert incompatibilities(plain, det)


def test_newer_version_unknown_and_missing_keys_are_value_errors():
    data = deterministic.fingerprint("cpu").to_dict()
    with pytest.raises(ValueError, match="newer"):
        NumericsFingerprint.from_dict({**data, "fingerprint_version": FINGERPRINT_VERSION + 1}, source="f.json")
    with pytest.raises(ValueError, match="f.json: unknown key.*bogus"):
        NumericsFingerprint.from_dict({**data, "bogus": 1}, source="f.json")
    missing = dict(data)
    del missing["blas"]
    with pytest.raises(ValueError, match="missing key.*blas"):
        NumericsFingerprint.from_dict(missing)
    with pytest.raises(ValueError, match="expected an object"):
        NumericsFingerprint.from_dict([1, 2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_fingerprint_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        deterministic.fingerprint("cuda")


def test_bi_mode_cpu_fingerprints_ignore_the_cpu_model_and_library_knobs():
    """G2 on every CPU: two BI-mode CPU fingerprints that differ only in the CPU, its flags,
    ATen's ISA, BLAS/oneDNN versions and their knobs are compatible (our kernels fix the bits)."""
    from titan_audit import batch_invariant

    with batch_invariant.enabled():
        bi = deterministic.fingerprint("cpu")
    assert bi.batch_invariant and bi.bi_kernels and bi.arch
    other_cpu = dataclasses.replace(
        bi,
        device_name="AMD EPYC 9654",
        cpu_capability="AVX2",
        cpu_isa_flags=("avx2", "fma"),
        blas="mkl 2025.0",
        onednn="v3.7",
        env={**bi.env, "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
    )
    assert incompatibilities(bi, other_cpu) == []
    # what can still change bits stays compared
    for change in (
        {"torch_version": "9.9"},
        {"bi_kernels": "titan-bi-cpu v0"},
        {"arch": "aarch64"},
        {"num_threads": bi.num_threads + 1},
        {"default_dtype": "float64"},
    ):
        assert incompatibilities(bi, dataclasses.replace(other_cpu, **change)), change
    # negative control: outside BI mode the same CPU change is an incompatibility
    plain = deterministic.fingerprint("cpu")
    assert plain.bi_kernels is None
    assert incompatibilities(plain, dataclasses.replace(plain, device_name="AMD EPYC 9654"))
    # a BI and a non-BI fingerprint never compare
    assert incompatibilities(bi, plain)


def test_version_1_fingerprints_still_read():
    data = deterministic.fingerprint("cpu").to_dict()
    old = {k: v for k, v in data.items() if k not in ("arch", "bi_kernels")}
    fp = NumericsFingerprint.from_dict({**old, "fingerprint_version": 1})
    assert fp.arch is None and fp.bi_kernels is None
