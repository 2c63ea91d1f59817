"""`golden record` / `golden update` refuse a model change and a run still being written (unless
--force), and `golden check` says the golden's true step range.

Proves: `golden update` of a tiny-dense golden by a tiny-moe run exits 2 with one line naming the
model key that differs, and leaves the golden byte for byte (--force replaces it); `golden record`
and `golden update` of a run whose writer lock (RUN/.lock, trainer.run_dir.claim_run_dir) is held
exit 2 naming the holder, and write nothing (--force records it); `golden check` of a 4-step
golden reports "(steps 1..4 only)". Negative controls: the same model updates (unchanged), the
released run records, `is_being_written` is False for a finished run and a directory without a
lock.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fault_injection import one_line_error as _one_line_error

from titan_audit.audit.run_lock import is_being_written, release, run_writer
from titan_audit.cli.main import cli
from titan_audit.trainer.config import load_config
from titan_audit.trainer.run_dir import claim_run_dir
from titan_audit.trainer.train import train

SMALL = [
    "steps=4",
    "checkpoint.interval=4",
    "data.global_batch_size=1",
    "data.seq_len=32",
    "data.synthetic_records=256",
    "parallel.threads=1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("golden-guards")
    for name, recipe in (("dense", "tiny-dense"), ("moe", "tiny-moe")):
        train(load_config(recipe, SMALL), root / name, quiet=True)
    torch.set_num_threads(threads)
    return root


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_update_refuses_another_model(runs, tmp_path):
    golden = tmp_path / "golden"
    assert _invoke("golden", "record", runs / "dense", golden).exit_code == 0
    before = _files(golden)
    result = _invoke("golden", "update", runs / "moe", golden)
    _one_line_error(result, str(runs / "moe"), "model differs", "model.preset: 'tiny-dense' -> 'tiny-moe'", "--force")
    assert _files(golden) == before
    # negative control: a run of the same model updates (here: nothing changed, not rewritten)
    same = _invoke("golden", "update", runs / "dense", golden, "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.output)["rewritten"] is False and _files(golden) == before
    # --force replaces it deliberately
    forced = _invoke("golden", "update", runs / "moe", golden, "--force", "--json")
    assert forced.exit_code == 0, forced.output
    manifest = json.loads((golden / "manifest.json").read_text())
    assert manifest["config"]["model"]["preset"] == "tiny-moe"


def test_record_and_update_refuse_a_run_being_written(runs, tmp_path):
    run = runs / "dense"
    golden, other = tmp_path / "golden", tmp_path / "other"
    assert not is_being_written(run) and run_writer(run) is None  # finished: its .lock is free
    assert (run / ".lock").is_file()
    assert _invoke("golden", "record", run, other).exit_code == 0
    claim_run_dir(run, resume=True, overwrite=False)  # the writer's lock, as a live train holds it
    try:
        assert is_being_written(run) and run_writer(run) == f"process {os.getpid()}"
        result = _invoke("golden", "record", run, golden)
        _one_line_error(result, str(run), "still being written", f"process {os.getpid()}", "--force")
        assert not golden.exists()
        before = _files(other)
        _one_line_error(_invoke("golden", "update", run, other), "still being written")
        assert _files(other) == before
        forced = _invoke("golden", "record", run, golden, "--force")
        assert forced.exit_code == 0, forced.output
    finally:
        release(run)
    assert not is_being_written(run)
    # negative control: released, the run records without --force
    assert _invoke("golden", "record", run, tmp_path / "third").exit_code == 0


def test_is_being_written_without_a_lock_file(tmp_path):
    assert not is_being_written(tmp_path) and not is_being_written(tmp_path / "missing")
    assert not (tmp_path / ".lock").exists()  # the probe creates nothing


def test_check_reports_the_goldens_true_step_range(runs, tmp_path):
    golden = tmp_path / "golden"
    assert _invoke("golden", "record", runs / "dense", golden).exit_code == 0
    result = _invoke("golden", "check", runs / "moe", golden)  # exact mode, records differ: the report shows
    assert result.exit_code == 1, result.output
    assert "(steps 1..4 only)" in result.output and "1..2 only" not in result.output
    data = json.loads(_invoke("golden", "check", runs / "moe", golden, "--json").output)
    assert data["audit"]["filters"]["steps"] == [1, 4] and data["audit"]["filters"]["golden_steps"] == [1, 2, 3, 4]
    gaps = tmp_path / "gaps"
    assert _invoke("golden", "record", runs / "dense", gaps, "--steps", "1-2,4").exit_code == 0
    gapped = _invoke("golden", "check", runs / "moe", gaps)
    assert gapped.exit_code == 1 and " only)" not in gapped.output  # no false range for steps with a gap
    data = json.loads(_invoke("golden", "check", runs / "moe", gaps, "--json").output)
    assert data["audit"]["filters"]["steps"] is None and data["audit"]["filters"]["golden_steps"] == [1, 2, 4]
