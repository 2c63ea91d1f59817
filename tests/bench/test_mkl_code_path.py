"""`machine.mkl_code_path`: the bench records which code path MKL (the native baseline's gemm) takes,
as MKL reports it, and scripts/mkl_intel_path.c (`make mkl-intel-path`) moves MKL onto the path
an Intel CPU of this ISA gets.

On an Intel CPU the shim changes nothing (MKL already takes that path); on an AMD CPU it is what
turns the generic path into the AVX-512 / AVX2 one. Either way the shimmed path must name the
CPU's widest ISA, and the control (the shim with `MKL_ENABLE_INSTRUCTIONS=AVX2`) must name AVX2
instead: the probe reads MKL's choice, it does not restate the CPU's flags."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from titan_audit.bench import SUITES, compare, run_suite
from titan_audit.bench.core import BenchOptions
from titan_audit.bench.mkl_path import mkl_code_path
from titan_audit.deterministic import fingerprint

pytestmark = pytest.mark.skipif(
    not torch.backends.mkl.is_available() or platform.machine() != "x86_64",
    reason="needs torch built with MKL on x86-64 (the shim answers MKL's CPU-vendor query)",
)


def test_the_shim_moves_mkl_onto_the_intel_path_of_this_cpus_isa(mkl_intel_path_shim):
    shim = mkl_intel_path_shim
    flags = set(fingerprint().cpu_isa_flags)
    if "avx2" not in flags:
        pytest.skip("the CPU has no AVX2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MKL_")}
    shimmed = mkl_code_path({**env, "LD_PRELOAD": str(shim)})
    widest = "AVX-512" if "avx512f" in flags else "AVX2"
    assert shimmed is not None and f"({widest})" in shimmed.replace("Intel(R) ", ""), shimmed
    # Control: MKL held to AVX2 under the same shim reports AVX2, not the CPU's widest ISA.
    held = mkl_code_path({**env, "LD_PRELOAD": str(shim), "MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert held is not None and "(AVX2)" in held.replace("Intel(R) ", "") and "AVX-512" not in held, held


def test_the_bench_json_records_the_path(monkeypatch):
    noop = ("noop", lambda: None)
    monkeypatch.setitem(SUITES, "hash", lambda options, progress: [compare("noop", noop, noop, options)])
    result = run_suite("hash", BenchOptions(repeats=1)).to_dict()
    assert result["machine"]["mkl_code_path"] == mkl_code_path()
    assert "LD_PRELOAD" in result["machine"]["info"]["env"]
