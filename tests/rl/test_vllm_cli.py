"""`--generator vllm` where vLLM is not installed: one line saying how to install the extra,
exit 2, nothing written (runs whether or not vLLM is installed: `available()` is patched)."""

from __future__ import annotations

import pytest
from vllm_common import cli_here, one_line_error

from titan_audit.rl import vllm as rl_vllm


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setattr(rl_vllm, "available", lambda: False)


@pytest.mark.parametrize(
    "args",
    [
        ["verify-onpolicy", "--config", "rl-tiny", "--steps", "1", "--generator", "vllm"],
        ["rl", "--config", "rl-tiny", "--generator", "vllm"],
        ["rl", "--config", "rl-tiny", "--set", "generator=vllm"],
    ],
)
def test_generator_vllm_without_vllm_says_how_to_install(no_vllm, tmp_path, args):
    proc = cli_here(*args, "--out", str(tmp_path / "run"))
    one_line_error(proc, r"needs the `vllm` extra: run `make setup`.*pip install -e '\.\[vllm\]'.*torchvision")
    assert not (tmp_path / "run").exists()


def test_available_is_false_without_the_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert rl_vllm.available() is False
    with pytest.raises(ValueError, match="pip install"):
        rl_vllm.require()


def test_bench_generate_vllm_without_vllm_says_how_to_install(no_vllm):
    one_line_error(cli_here("bench", "generate", "--generator", "vllm", "--quick"), r"pip install -e '\.\[vllm\]'")


def test_bench_generator_applies_to_generate_only():
    proc = cli_here("bench", "ops", "--generator", "vllm")
    assert proc.returncode == 2 and "--generator applies to the generate suite only" in proc.stderr
