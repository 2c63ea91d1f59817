"""What torchrun runs on a rank (trainer/rank_entry.py, rl/rank_entry.py) starts without runpy's
"found in sys.modules after import of package" RuntimeWarning: no module imports an entry, and
`python -m ENTRY` with warnings as errors gets as far as the rank's own work (here: a config the
rank refuses, its one-line error). The real 2-rank launches check their stderr too
(tests/trainer/test_launch_errors.py, tests/rl/test_loop.py)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit.rl.job import RLJob
from titan_audit.trainer.train_job import TrainJob

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_no_module_imports_a_rank_entry():
    for path in (ROOT / "titan_audit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            assert not any(n.endswith("rank_entry") for n in names), path


@pytest.mark.parametrize("job", [TrainJob, RLJob], ids=["train", "rl"])
def test_a_rank_entry_starts_without_the_runpy_warning(job, tmp_path):
    launch_file = tmp_path / "launch.json"
    launch_file.write_text(json.dumps({"kind": job.kind, "config": {"steps": 0}, "options": {}}))
    done = run_module(job.rank_entry, str(launch_file), str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == "Error: steps must be >= 1, got 0", done.stderr[-2000:]


def test_a_rank_entry_refuses_a_launch_file_of_another_job(tmp_path):
    """The launch file names its job: the train entry refuses an RL one (control: its own kind
    gets as far as the config, above)."""
    launch_file = tmp_path / "launch.json"
    launch_file.write_text(json.dumps({"kind": "rl", "config": {"steps": 0}, "options": {}}))
    done = run_module(TrainJob.rank_entry, str(launch_file), str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        f"Error: {launch_file}: the launch file of a job of kind 'rl', read by the 'train' rank entry"
    ), done.stderr[-2000:]


def test_control_an_entry_its_package_imports_does_warn(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import entry\n")
    (package / "entry.py").write_text("")
    done = run_module("pkg.entry", cwd=tmp_path)
    assert done.returncode != 0 and "RuntimeWarning" in done.stderr and "found in sys.modules" in done.stderr
