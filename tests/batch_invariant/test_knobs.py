"""G2 on every CPU: BI results do not depend on our ISA variant or on any library dispatch knob.

Each case starts a fresh process (the knobs are read at process start) with one of: our kernel
variants forced (TITAN_AUDIT_CPU_ISA=scalar|avx2|avx512, those this CPU has), ATen's dispatch
ISA forced (ATEN_CPU_CAPABILITY=default|avx2|avx512), ONEDNN_MAX_CPU_ISA=AVX2, MKL_CBWR=COMPATIBLE.
Every case must give the same audit hashes for the BI ops, their backward, weight init, a BI
model forward, a BI paged KV-cache decode (head_dim 128) and the RoPE table of qwen3's shapes.
Negative controls: torch's own sum, AdamW, normal_ and cos change bits under
ATEN_CPU_CAPABILITY=default, so the knobs really took effect and the comparison can fail; and
torch.sqrt (MKL VML, chosen by CPU vendor) is not the correctly rounded root on some inputs (on
every vendor; MKL_CBWR moves VML on Intel only, so a knob test alone cannot see this). The whole BI
training run under these knobs is in test_knobs_train.py.
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


def _probe(env: dict[str, str]) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("TITAN_AUDIT_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run(
        [sys.executable, str(PROBE)], env={**full, **env}, capture_output=True, text=True, timeout=300
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
def test_negative_control_the_capability_knob_changes_native_bits(reference: dict) -> None:
    default = _probe({"ATEN_CPU_CAPABILITY": "default"})
    assert default["capability"] == "DEFAULT"
    differing = [name for name in reference["native"] if default["native"][name] != reference["native"][name]]
    assert differing, "torch's own sum/AdamW/normal_/cos gave the same bits under ATEN_CPU_CAPABILITY=default"


def test_negative_control_native_sqrt_is_not_correctly_rounded(reference: dict) -> None:
    """Why BI mode routes sqrt to our kernel: torch.sqrt on a CPU tensor runs MKL's VML, whose code
    path the CPU vendor picks (1 ulp off on ~17% of these inputs on an AMD EPYC, ~0.6% on an
    AVX-512 Xeon; MKL_CBWR moves it on Intel only). Checked against the correctly rounded root,
    not against another CPU, so the control holds on both vendors."""
    assert reference["native"]["native_sqrt_not_correctly_rounded"] > 0
