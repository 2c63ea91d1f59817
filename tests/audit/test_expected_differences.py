"""`compare` says why bits may differ before it shows that they do: a tensor-parallel layout outside
batch-invariant mode is named as the expected cause (`audit.config_diff.expected_differences`);
the same layouts in BI mode, and native runs at one TP degree, get no such warning (the controls).
The end-to-end check on real TP=1 / TP=2 runs is in tests/trainer/test_tensor_parallel.py."""

import json

import pytest

from titan_audit.audit.config_diff import CONFIG_KEYS_IGNORED, expected_differences, run_expected_differences


def _config(tp: int | None, bi: bool) -> dict:
    parallel = {} if tp is None else {"tp": tp}
    return {"seed": 0, "parallel": parallel, "determinism": {"batch_invariant": bi}}


def test_a_native_tp_layout_change_is_named_with_its_cause():
    (warning,) = expected_differences(_config(1, False), _config(2, False))
    assert "parallel.tp: 1 -> 2" in warning and "batch-invariant mode is off in A and B" in warning
    assert "parallel.tp" in CONFIG_KEYS_IGNORED  # so config_differences alone never shows it
    (one_side,) = expected_differences(_config(2, True), _config(1, False), names=("golden", "run"))
    assert "off in run (" in one_side
    (missing_key,) = expected_differences(_config(None, False), _config(2, False))  # a run before the key: TP=1
    assert "parallel.tp: 1 -> 2" in missing_key


@pytest.mark.control
def test_controls_bi_mode_or_one_tp_degree_expect_equal_bits():
    assert expected_differences(_config(1, True), _config(2, True)) == []
    assert expected_differences(_config(2, False), _config(2, False)) == []
    assert expected_differences(_config(1, False), _config(None, False)) == []


def _run(path, config):
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"config": config}))
    return path


def test_run_directories_without_a_config_expect_nothing(tmp_path):
    a = _run(tmp_path / "a", _config(1, False))
    b = _run(tmp_path / "b", _config(2, False))
    (tmp_path / "bare").mkdir()
    assert len(run_expected_differences(a, b)) == 1
    assert run_expected_differences(a, tmp_path / "bare") == []
