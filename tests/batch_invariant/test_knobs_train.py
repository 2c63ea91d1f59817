"""G2 + G3 on every CPU: a BI tiny-dense training run has the same audit hashes whatever kernel
variant is forced and whatever library knob is set. The reference runs at W=2 (torchrun) with no
knob; each variant runs at W=1 in a fresh process (the knobs are read at process start), so every
comparison checks the world size and the knob at once. `compare_runs` must report them identical.
Negative control: a run with another seed is reported different by the same comparison.
Runs are 2 steps of V = 2 microbatches (one per rank at W = 2): every kernel of a step runs for
each microbatch, so more of them would repeat the same kernels (the scalar variant's software fma
made V = 8 cost minutes); the world-size guarantee at the recipe's V = 8 is tests/trainer/test_train.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit.audit import compare_runs
from titan_audit.batch_invariant.cpu import _lib

STEPS = 2
BI = ["--set", "determinism.batch_invariant=true", "--set", "parallel.threads=1", "--set", "data.global_batch_size=2"]


def _train(out: Path, env: dict[str, str], *extra: str, nproc: int = 1) -> Path:
    base = {k: v for k, v in os.environ.items() if k not in ("TITAN_AUDIT_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    cmd = [
        sys.executable,
        "-m",
        "titan_audit.cli",
        "train",
        "--config",
        "tiny-dense",
        "--out",
        str(out),
        *(["--nproc", str(nproc)] if nproc > 1 else []),
        "--steps",
        str(STEPS),
        *BI,
        *extra,
    ]
    proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _compare(a: Path, b: Path) -> dict:
    return compare_runs(a, b).to_dict()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("knobs") / "reference", {}, nproc=2)


def _cases() -> list:
    variants = [{"TITAN_AUDIT_CPU_ISA": isa} for isa in ("scalar", "avx2")]
    knobs = [
        {"ATEN_CPU_CAPABILITY": "default"},
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"},
    ]
    return [pytest.param(env, id=",".join(f"{k}={v}" for k, v in env.items())) for env in variants + knobs]


@pytest.mark.slow
@pytest.mark.parametrize("env", _cases())
def test_bi_training_is_identical_under_every_variant_and_knob(reference: Path, tmp_path: Path, env: dict) -> None:
    isa = env.get("TITAN_AUDIT_CPU_ISA")
    if isa is not None and isa not in _lib.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} variant")
    run = _train(tmp_path / "run", env)
    result = _compare(reference, run)
    assert result["identical"], result.get("first_divergence")


@pytest.mark.slow
def test_negative_control_another_seed_is_reported_different(reference: Path, tmp_path: Path) -> None:
    run = _train(tmp_path / "seed1", {}, "--set", "seed=1")
    assert not _compare(reference, run)["identical"]
