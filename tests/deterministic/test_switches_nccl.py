"""NCCL switches: deterministic mode on a CUDA machine pins NCCL's reduction order (and restores
the environment on exit); on a CPU machine the NCCL variables are left alone and CPU
fingerprints do not record them (so existing CPU fingerprints and goldens compare as before)."""

from __future__ import annotations

import os

import pytest
import torch

from titan_audit import deterministic
from titan_audit.deterministic import numerics, switches


def test_cuda_switches_pin_nccl_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in switches.NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    saved = switches.Switches.read()
    switches.deterministic_switches(True, 1, cuda=True).apply()
    try:
        assert {n: os.environ.get(n) for n in switches.NCCL_ENV} == switches.NCCL_ENV
        assert switches.NCCL_ENV["NCCL_ALGO"] == "Ring" and switches.NCCL_ENV["NCCL_PROTO"] == "Simple"
    finally:
        saved.apply()
    assert all(n not in os.environ for n in switches.NCCL_ENV)


@pytest.mark.skipif(torch.cuda.is_available(), reason="deterministic.enable pins NCCL on a CUDA machine")
def test_cpu_leaves_nccl_alone_and_fingerprint_keys_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert switches.deterministic_switches(True, 1, cuda=False).nccl_env[0] == ("NCCL_ALGO", "Tree")
    with deterministic.enable(0):
        assert os.environ["NCCL_ALGO"] == "Tree"
        fp = numerics.fingerprint("cpu")
    assert not set(numerics.NCCL_ENV_VARS) & set(fp.env)
