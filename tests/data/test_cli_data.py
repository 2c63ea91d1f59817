"""`titan-audit data`: synth -> prepare -> inspect/plan, and one-line errors with exit code 2."""

import json

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, list(map(str, args)))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    result = _run("data", "synth", tmp / "t.parquet", "--num", 600, "--seed", 2, "--row-group-size", 100)
    assert result.exit_code == 0, result.output
    result = _run("data", "prepare", tmp / "t.parquet", "--out", tmp / "t.zarr", "--workers", 0, "--json")
    assert result.exit_code == 0, result.output
    return tmp, json.loads(result.stdout)


def test_prepare_inspect_and_plan(prepared):
    tmp, info = prepared
    assert info["num_docs"] == 600 and info["tokenizer"] == "byte-v1"
    inspected = json.loads(_run("data", "inspect", tmp / "t.zarr", "--json").stdout)
    assert inspected["manifest_digest"] == info["manifest_digest"]
    assert inspected["origin"][0]["name"] == "t.parquet" and inspected["origin"][0]["rows"] == 600
    args = ["data", "plan", tmp / "t.zarr", "--seq-len", 32, "--global-batch", 8, "--microbatch", 2, "--json"]
    plan = json.loads(_run(*args, "--world-size", 2, "--step", 3).stdout)
    assert plan["num_microbatches"] == 4 and plan["ranks"] == {"0": [0, 1], "1": [2, 3]}
    assert len(set(plan["microbatch_token_hashes"])) == 4
    again = json.loads(_run(*args, "--world-size", 4, "--step", 3).stdout)
    assert again["microbatch_hashes"] == plan["microbatch_hashes"]  # W does not change the batch
    other = json.loads(_run(*args, "--step", 4).stdout)
    assert other["microbatch_token_hashes"] != plan["microbatch_token_hashes"]  # negative control


@pytest.mark.parametrize(
    "args, message",
    [
        (["data", "prepare", "{tmp}/missing.parquet", "--out", "{tmp}/x.zarr"], "missing.parquet: no such file"),
        (
            ["data", "prepare", "{tmp}/t.parquet", "--out", "{tmp}/x.zarr", "--text-column", "body"],
            "no text column 'body'",
        ),
        (["data", "prepare", "{tmp}/t.parquet", "--out", "{tmp}/t.zarr"], "t.zarr already exists"),
        (["data", "inspect", "{tmp}/t.parquet"], "not a token store"),
        (
            ["data", "plan", "{tmp}/t.zarr", "--seq-len", "32", "--global-batch", "10", "--microbatch", "4"],
            "global batch size 10 is not divisible by microbatch size 4",
        ),
        (
            [
                "data",
                "plan",
                "{tmp}/t.zarr",
                "--seq-len",
                "32",
                "--global-batch",
                "8",
                "--microbatch",
                "2",
                "--world-size",
                "3",
            ],
            "world size 3 does not divide the 4 virtual microbatches",
        ),
        (["data", "synth", "{tmp}/t.parquet"], "t.parquet already exists"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(prepared, args, message):
    tmp, _ = prepared
    result = _run(*[a.format(tmp=tmp) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.output
