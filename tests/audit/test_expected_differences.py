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


def test_digest_settings_that_differ_are_named(tmp_path):
    """A run's manifest says how its records were hashed (`digest`); two runs that say otherwise,
    or one recorded before runs said it (lattice version 1 above C) whose records differ, are
    named with that cause; controls: the same settings, or no difference found, say nothing."""
    from titan_audit.audit.run_manifest import digest_differences, digest_settings

    now = digest_settings()
    assert now == {"lattice": 2, "whole_hash_bytes": 2 << 20}
    old = {"lattice": 1, "whole_hash_bytes": 2 << 20}
    (named,) = digest_differences({"digest": old}, {"digest": now}, differed=False)
    assert "'lattice': 1" in named and "'lattice': 2" in named
    (before,) = digest_differences({}, {"digest": now}, ("golden", "run"), differed=True)
    assert before.startswith("golden was recorded before manifests named their digest")
    assert digest_differences({}, {"digest": now}, differed=False) == []
    assert digest_differences({"digest": now}, {"digest": dict(now)}, differed=True) == []
    a = _run(tmp_path / "a", _config(1, True))
    b = _run(tmp_path / "b", _config(1, True))
    manifest = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**manifest, "digest": now}))
    assert run_expected_differences(a, b) == []
    (warning,) = run_expected_differences(a, b, differed=True)
    assert warning.startswith("A was recorded before")
