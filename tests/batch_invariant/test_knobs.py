"""G2 on every CPU: BI results do not depend on our ISA variant or on any library dispatch knob.

Each case starts a fresh process (the knobs are read at process start) with one of: our kernel
variants forced (TITAN_AUDIT_CPU_ISA=scalar|avx2|avx512, those this CPU has), ATen's dispatch
ISA forced (ATEN_CPU_CAPABILITY=default|avx2|avx512), ONEDNN_MAX_CPU_ISA=AVX2, MKL_CBWR=COMPATIBLE.
Every case must give the same audit hashes for the BI ops, their backward, weight init, a BI
model forward, a BI paged KV-cache decode (head_dim 128) and the RoPE table of qwen3's shapes.
Negative control: the same probe in gemm order v1 gives other hashes, so the comparison can
fail. The capability knob took effect: the probe's ATen reports the forced capability. Which of
torch's own sum, AdamW, cos, sqrt and normal_ change bits under a knob is reported, not asserted
(that depends on the CPU: MKL_CBWR moves MKL's VML on Intel only). The routed sqrt's control is in
test_census.py. The whole BI training run under these knobs is in test_knobs_train.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit.batch_invariant.cpu import _lib

PROBE = Path(__file__).with_name("_knob_probe.py")
KNOBS = [
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"MKL_CBWR": "COMPATIBLE"},
]


def _probe(env: dict[str, str], *args: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("TITAN_AUDIT_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run(
        [sys.executable, str(PROBE), *args], env={**full, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _probe({})


@pytest.mark.slow
@pytest.mark.parametrize("isa", _lib.ISAS)
def test_every_kernel_variant_gives_the_same_bits(reference: dict, isa: str) -> None:
    if isa not in _lib.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant")
    result = _probe({"TITAN_AUDIT_CPU_ISA": isa})
    assert result["isa"] == isa
    assert result["bi"] == reference["bi"]


@pytest.mark.slow
@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_library_knobs_do_not_change_bi_bits(reference: dict, knob: dict[str, str]) -> None:
    result = _probe(knob)
    assert result["bi"] == reference["bi"]


@pytest.mark.slow
def test_negative_control_another_gemm_order_gives_other_hashes(reference: dict) -> None:
    """The knob comparison can fail: the BI results summed in gemm order v1 (the gemms' K in one
    chain, not v2's tree) give other hashes than the reference."""
    other = _probe({}, "--gemm-order", "v1")
    differing = sorted(name for name in reference["bi"] if other["bi"][name] != reference["bi"][name])
    assert other["bi"] != reference["bi"]
    assert {"linear", "forward"} <= set(differing), differing


@pytest.mark.slow
def test_the_capability_knob_takes_effect(reference: dict) -> None:
    """ATEN_CPU_CAPABILITY=default reaches ATen: it reports the forced capability. Which native
    ops changed bits with it is reported only."""
    if reference["capability"] == "DEFAULT":
        pytest.skip("ATen runs its default capability on this CPU: forcing it shows nothing")
    default = _probe({"ATEN_CPU_CAPABILITY": "default"})
    assert default["capability"] == "DEFAULT"
    differing = [name for name in reference["native"] if default["native"][name] != reference["native"][name]]
    print(f"native ops with other bits under ATEN_CPU_CAPABILITY=default: {differing}")
    print(f"native sqrt, roots not correctly rounded: {reference['native']['native_sqrt_not_correctly_rounded']}")
