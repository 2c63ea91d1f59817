"""An empty selection is bad input (exit 2, one line naming it and what exists), never a green check;
`compare` lists config differences first.

Proves: `compare A B` with `--steps 9:12` on 4-step runs, `--names 'nosuch*'`, `--phase rollout`
or a combination that selects nothing together exits 2 with one line naming the selection and
what the runs hold; two runs without a record exit 2 (`compare`, `report --against`); `golden
check` of a run holding none of the golden's steps exits 2 (exact mode: no audit record; tolerance
mode: no metric value). Negative controls: valid selections still compare records (exit 0), and
the golden's own run still passes. Config differences: `compare` of runs with another seed lists
"seed: 0 -> 1" first (text) and under "config_differences" (--json), the verdict staying the
records' (a config difference with identical records exits 0).
(`bisect` of two empty op logs: tests/faults/test_bisect_scalars.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import torch
from click.testing import CliRunner
from fault_injection import one_line_error as _one_line_error

from titan_audit.audit.compare import compare_runs
from titan_audit.audit.log import AuditLogWriter, part_files, read_audit_log
from titan_audit.audit.run_metrics import MetricsLog
from titan_audit.audit.schema import SCHEMA
from titan_audit.cli.main import cli
from titan_audit.trainer.config import load_config
from titan_audit.trainer.train import train

SMALL = [
    "steps=4",
    "checkpoint.interval=4",
    "data.global_batch_size=1",
    "data.seq_len=32",
    "data.synthetic_records=256",
    "parallel.threads=1",
]


def _edit_manifest(run: Path, edit) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    edit(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))


def _keep_steps(run: Path, steps: list[int]) -> None:
    """Rewrite a copied run's audit log and metrics with only `steps` (a run that stopped early)."""
    records = read_audit_log(run, filter=ds.field("step").isin(steps))
    for part in part_files(run):
        part.unlink()
    AuditLogWriter(run).write(records.select(SCHEMA.names).to_pydict())
    metrics = MetricsLog(run)
    metrics.truncate_after(max(steps))
    metrics.flush()
    assert [row["step"] for row in metrics.rows] == steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("empty-selections")
    train(load_config("tiny-dense", SMALL), root / "a", quiet=True)
    train(load_config("tiny-dense", [*SMALL, "seed=1"]), root / "seed1", quiet=True)
    torch.set_num_threads(threads)
    # the same records, another config value: a difference that is information only
    shutil.copytree(root / "a", root / "clip")
    _edit_manifest(root / "clip", lambda m: m["config"]["optimizer"].update(grad_clip=2.0))
    # a run that holds steps 1..2 only, and the same with an incompatible numerics fingerprint
    shutil.copytree(root / "a", root / "early")
    _keep_steps(root / "early", [1, 2])
    shutil.copytree(root / "early", root / "early-other-fp")
    _edit_manifest(
        root / "early-other-fp", lambda m: m["fingerprint"].update(num_threads=m["fingerprint"]["num_threads"] + 7)
    )
    # two runs without a single audit record
    for name in ("empty1", "empty2"):
        (root / name / "audit").mkdir(parents=True)
        shutil.copy(root / "a" / "manifest.json", root / name / "manifest.json")
        shutil.copytree(root / "a" / "metrics.parquet", root / name / "metrics.parquet")
    for name, steps in (("golden-34", "3-4"), ("golden-12", "1-2")):
        result = _invoke("golden", "record", root / "a", root / name, "--steps", steps)
        assert result.exit_code == 0, result.output
    return root


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


# ------------------------------------------------------------------------------------ compare
def test_steps_past_the_run(runs):
    result = _invoke("compare", runs / "a", runs / "seed1", "--steps", "9:12")
    _one_line_error(result, "--steps 9:12 selects no records: A and B have steps 1..4")
    early = _invoke("compare", runs / "a", runs / "early", "--steps", "5:")
    _one_line_error(early, "--steps 5: selects no records: A has steps 1..4, B has steps 1..2")


def test_names_matching_nothing(runs):
    line = _one_line_error(_invoke("compare", runs / "a", runs / "a", "--names", "nosuch*"))
    assert "--names 'nosuch*' matches no record name; names look like: " in line
    assert "embed_tokens.weight" in line


def test_phase_with_no_records_and_a_combination(runs):
    _one_line_error(
        _invoke("compare", runs / "a", runs / "a", "--phase", "rollout"),
        "--phase rollout selects no records: A and B have phases data, loss, grad, optim, param",
    )
    # each filter matches on its own, together nothing: both are named
    both = _invoke("compare", runs / "a", runs / "a", "--phase", "grad", "--names", "doc_ids")
    _one_line_error(both, "--phase grad --names 'doc_ids' select no records together")


def test_negative_control_valid_selections_compare_records(runs):
    for args in (["--steps", "2:3"], ["--names", "embed*"], ["--phase", "grad"], ["--steps", "4"]):
        result = _invoke("compare", runs / "a", runs / "clip", *args, "--json")
        assert result.exit_code == 0, (args, result.output)
        assert json.loads(result.output)["compared"] > 0
    # one side empty is a difference, not bad input
    assert _invoke("compare", runs / "a", runs / "early", "--steps", "3:4").exit_code == 1


def test_runs_without_records(runs):
    _one_line_error(_invoke("compare", runs / "empty1", runs / "empty2"), "hold no audit records: nothing to compare")
    _one_line_error(_invoke("report", runs / "empty1", "--against", runs / "empty2"), "hold no audit records")
    assert not (runs / "empty1" / "reports").exists()  # nothing written
    with pytest.raises(ValueError, match="hold no audit records"):
        compare_runs(runs / "empty1", runs / "empty2")


# ------------------------------------------------------------------------------------ golden check
def test_golden_check_of_a_run_without_the_goldens_steps(runs):
    _one_line_error(
        _invoke("golden", "check", runs / "early", runs / "golden-34"),
        str(runs / "early"),
        "no audit records at the golden's steps 3..4",
        "the run has steps 1..2",
    )
    _one_line_error(
        _invoke("golden", "check", runs / "early-other-fp", runs / "golden-34"),
        "no metric values at the golden's steps 3..4",
        "has steps 1..2",
    )
    # negative controls: the golden's own steps pass, exact and in tolerance mode
    assert _invoke("golden", "check", runs / "a", runs / "golden-34").exit_code == 0
    assert _invoke("golden", "check", runs / "early", runs / "golden-12").exit_code == 0
    tolerance = _invoke("golden", "check", runs / "early-other-fp", runs / "golden-12", "--json")
    assert tolerance.exit_code == 0, tolerance.output
    assert json.loads(tolerance.output)["mode"] == "tolerance"


# ------------------------------------------------------------------------------------ config differences
def test_compare_lists_config_differences_first(runs):
    text = _invoke("compare", runs / "a", runs / "seed1")
    assert text.exit_code == 1, text.output
    lines = text.output.splitlines()
    assert lines[0] == "config differs: seed: 0 -> 1"
    verdict = next(i for i, line in enumerate(lines) if line.startswith("first divergence"))
    assert verdict > 0
    data = json.loads(_invoke("compare", runs / "a", runs / "seed1", "--json").output)
    assert data["config_differences"] == ["seed: 0 -> 1"]


def test_config_differences_are_information_not_a_failure(runs):
    result = _invoke("compare", runs / "a", runs / "clip")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "config differs: optimizer.grad_clip: 1.0 -> 2.0"
    assert "identical:" in result.output
    # negative control: the same run has no config differences
    same = json.loads(_invoke("compare", runs / "a", runs / "a", "--json").output)
    assert same["config_differences"] == [] and same["identical"]
    plain = _invoke("compare", runs / "a", runs / "a")
    assert "config differs" not in plain.output
