"""A golden recorded before the clip norm's order v2 (trainer/grad_norm.py) still checks exact,
and a run in the new order fails it naming the key.

tests/golden/norm_v1/tiny-dense-bi is the committed tiny-dense-bi golden as it was before v2 became
the default (its config has no `determinism.grad_norm`: it reads as "v1", audit/config_diff.py
ADDED_KEY_DEFAULTS). A run made with `--set determinism.grad_norm=v1` checks exact against it.
Negative control: the committed golden, now a v2 run of the same recipe, fails it under
--require-exact and the check names `determinism.grad_norm`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_audit.golden import check_golden
from titan_audit.golden.pytest_plugin import train_recipe
from titan_audit.goldens import GOLDENS_DIR

NORM_V1_GOLDEN = Path(__file__).parent / "norm_v1" / "tiny-dense-bi"

pytestmark = pytest.mark.skipif("config.getoption('--golden-update')", reason="checks committed goldens")


@pytest.mark.slow  # 4 steps of tiny-dense in BI mode, ~15 s on 2 shared cores
def test_a_pre_v2_norm_golden_checks_exact_with_a_v1_norm_run(tmp_path):
    out = tmp_path / "run"
    train_recipe(out, "tiny-dense", steps=4, overrides=["determinism.batch_invariant=true", "determinism.grad_norm=v1"])
    result = check_golden(out, NORM_V1_GOLDEN, require_exact=True)
    assert result.passed and result.mode == "exact", result.to_dict()
    assert result.config_differences == []


def test_a_v2_norm_run_fails_the_v1_norm_golden_naming_the_key():
    result = check_golden(GOLDENS_DIR / "tiny-dense-bi", NORM_V1_GOLDEN, require_exact=True)
    assert not result.passed
    assert "determinism.grad_norm: golden 'v1', run 'v2'" in result.config_differences
