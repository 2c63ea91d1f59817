"""A golden recorded before gemm order v2 existed still checks exact, and a kernel-order change is
named as the cause of a failure.

tests/golden/v1/tiny-dense-bi is the committed tiny-dense-bi golden as it was before v2 became the
default (its config has no `determinism.bi_kernels`, its fingerprint says "titan-bi-cpu v2"). A
run made with `--set determinism.bi_kernels=v1` checks exact against it (the missing key reads as
"v1", audit/config_diff.py ADDED_KEY_DEFAULTS). Negative control: a v2 run of the same recipe (the
committed v2 golden's run) fails it under --require-exact, with the note that the kernels (the
gemm order) changed and the key to set; the v1 run against the v2 golden fails the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli
from titan_audit.golden import check_golden
from titan_audit.golden.pytest_plugin import train_recipe
from titan_audit.goldens import GOLDENS_DIR

V1_GOLDEN = Path(__file__).parent / "v1" / "tiny-dense-bi"
V2_GOLDEN = GOLDENS_DIR / "tiny-dense-bi"
BI = ["determinism.batch_invariant=true"]
OLD = "titan-bi-cpu v2"  # kernel library version 2, gemm order v1 (numerics._bi_kernels)
NEW = "titan-bi-cpu v2 gemm-v2"

pytestmark = pytest.mark.skipif("config.getoption('--golden-update')", reason="checks committed goldens")


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v1") / "run"
    # the golden predates both orders: gemm v1 and the clip norm's v1 (trainer/grad_norm.py)
    train_recipe(out, "tiny-dense", steps=4, overrides=[*BI, "determinism.bi_kernels=v1", "determinism.grad_norm=v1"])
    return out


@pytest.mark.slow  # the v1 run: 4 steps of tiny-dense, ~15 s on 2 shared cores
def test_a_pre_v2_golden_checks_exact_with_a_v1_run(v1_run):
    result = check_golden(v1_run, V1_GOLDEN, require_exact=True)
    assert result.passed and result.mode == "exact", result.to_dict()
    assert result.config_differences == [] and result.kernels_changed is None


def test_a_v2_run_fails_the_v1_golden_and_the_check_names_the_kernel_change():
    """Negative control: the committed v2 golden is a v2 run of the same recipe (default order)."""
    result = check_golden(V2_GOLDEN, V1_GOLDEN, require_exact=True)
    assert not result.passed and result.mode == "tolerance"
    assert result.kernels_changed == {"golden": OLD, "run": NEW}
    assert "determinism.bi_kernels: golden 'v1', run 'v2'" in result.config_differences
    out = CliRunner().invoke(cli, ["golden", "check", str(V2_GOLDEN), str(V1_GOLDEN), "--require-exact"])
    assert out.exit_code == 1, out.output
    text = " ".join(out.output.split())
    assert f"the batch-invariant kernels changed version (golden '{OLD}', run '{NEW}')" in text
    assert "the gemm order differs (golden v1, run v2)" in text
    assert "--set determinism.bi_kernels=v1 checks exact against this golden" in text


@pytest.mark.slow
def test_a_v1_run_fails_the_v2_golden_naming_the_order(v1_run):
    result = check_golden(v1_run, V2_GOLDEN, require_exact=True)
    assert not result.passed and result.kernels_changed == {"golden": NEW, "run": OLD}
    assert "determinism.bi_kernels: golden 'v2', run 'v1'" in result.config_differences
