"""Run directories: never overwritten silently; manifest and metrics written atomically."""

import json

import pytest

from titan_audit.trainer.run_dir import MetricsLog, prepare_run_dir, read_manifest, write_manifest


def test_new_run_dir_then_refuse_reuse_without_resume_or_overwrite(tmp_path):
    run = prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    write_manifest(run, {"config": {"seed": 1}})
    with pytest.raises(ValueError, match="holds a run; use --resume .* or --overwrite"):
        prepare_run_dir(run, resume=False, overwrite=False)
    assert prepare_run_dir(run, resume=True, overwrite=False) == run


def test_overwrite_moves_the_old_run_aside_instead_of_deleting_it(tmp_path):
    run = prepare_run_dir(tmp_path / "run", resume=False, overwrite=False)
    write_manifest(run, {"config": {"seed": 1}})
    prepare_run_dir(run, resume=False, overwrite=True)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(kept) == 1 and read_manifest(kept[0])["config"] == {"seed": 1}
    assert list(run.iterdir()) == []


def test_bad_run_dirs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no run to resume"):
        prepare_run_dir(tmp_path / "missing", resume=True, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        prepare_run_dir(tmp_path / "file", resume=False, overwrite=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        prepare_run_dir(tmp_path / "full", resume=False, overwrite=False)
    with pytest.raises(ValueError, match="exclude each other"):
        prepare_run_dir(tmp_path / "r", resume=True, overwrite=True)


def test_manifest_format_checks(tmp_path):
    with pytest.raises(ValueError, match="not a run directory"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="newer titan-audit"):
        read_manifest(tmp_path)


def test_metrics_round_trip_and_truncate_for_resume(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(5):
        log.append({"step": step, "loss": 1.0 / (step + 1)})
    log.flush()
    again = MetricsLog(tmp_path)
    assert [r["step"] for r in again.rows] == [0, 1, 2, 3, 4]
    again.truncate_after(2)
    again.flush()
    assert [r["step"] for r in MetricsLog(tmp_path).rows] == [0, 1, 2]
    assert not list(tmp_path.glob(".*.tmp"))
