"""`titan-audit compare`: exit codes 0/1/2, one-line errors naming the file, --json, filters."""

import json

import pytest
from audit._audit_runs import Perturb, train
from click.testing import CliRunner

from titan_audit.audit.log import part_files
from titan_audit.cli.main import cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train(root / "a", steps=2)
    train(root / "same", steps=2)
    train(root / "other", steps=2, perturb=Perturb("forward", 1, "blocks.0.fc2", 1))
    return root


def _invoke(*args):
    return CliRunner().invoke(cli, ["compare", *map(str, args)])


def test_identical_exit_0(runs):
    result = _invoke(runs / "a", runs / "same")
    assert result.exit_code == 0, result.output
    assert "identical" in result.output


def test_difference_exit_1_names_first_divergence(runs):
    result = _invoke(runs / "a", runs / "other")
    assert result.exit_code == 1, result.output
    assert "first divergence: step 1, phase forward, microbatch 1, name blocks.0.fc2 (hashes differ)" in result.output
    assert "spread" in result.output


def test_json_is_one_object(runs):
    result = _invoke(runs / "a", runs / "other", "--json")
    assert result.exit_code == 1
    data = json.loads(result.output)  # the whole of stdout is one JSON object
    first = data["first_divergence"]
    assert (first["step"], first["phase"], first["microbatch"], first["name"]) == (1, "forward", 1, "blocks.0.fc2")
    same = json.loads(_invoke(runs / "a", runs / "same", "--json").output)
    assert same["identical"] is True and same["first_divergence"] is None
    assert list(same) == list(data)


def test_phase_and_names_filters(runs):
    assert _invoke(runs / "a", runs / "other", "--phase", "data").exit_code == 0
    assert _invoke(runs / "a", runs / "other", "--names", "blocks.0.fc2", "--phase", "forward").exit_code == 1
    assert _invoke(runs / "a", runs / "other", "--names", "blocks.0.fc1", "--phase", "forward").exit_code == 0
    assert _invoke(runs / "a", runs / "other", "--names", "embed", "--phase", "forward").exit_code == 0
    bad = _invoke(runs / "a", runs / "other", "--phase", "fwd")
    assert bad.exit_code == 2


def _assert_user_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output


def test_missing_directory_exit_2(runs, tmp_path):
    _assert_user_error(_invoke(runs / "a", tmp_path / "nope"), str(tmp_path / "nope"), "no such directory")


def test_not_a_run_exit_2(runs, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _assert_user_error(_invoke(tmp_path, runs / "a"), str(tmp_path), "not a run")
    _assert_user_error(_invoke(tmp_path / "notes.txt", runs / "a"), "notes.txt", "not a directory")


def test_truncated_parquet_exit_2_names_the_file(runs, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(runs / "a", broken)
    part = part_files(broken)[-1]
    part.write_bytes(part.read_bytes()[: len(part.read_bytes()) // 2])
    _assert_user_error(_invoke(runs / "a", broken), str(part), "not a readable Parquet file")


def test_incompatible_fingerprints_explained_first(runs, tmp_path):
    import shutil

    from titan_audit.deterministic import fingerprint

    for name in ("a", "same"):
        shutil.copytree(runs / name, tmp_path / name)
    fp = fingerprint("cpu").to_dict()
    (tmp_path / "a" / "manifest.json").write_text(json.dumps({"format": 1, "fingerprint": fp}))
    fp["torch_version"] = "0.0.1"
    (tmp_path / "same" / "manifest.json").write_text(json.dumps({"format": 1, "fingerprint": fp}))
    result = _invoke(tmp_path / "a", tmp_path / "same")
    assert result.exit_code == 0
    first_line = result.output.splitlines()[0]
    assert first_line.startswith("warning: the runs have incompatible numerics fingerprints")
    assert "torch_version" in first_line
