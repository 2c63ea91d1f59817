"""`bench reduce --quick --json` runs on real gloo ranks and follows the bench schema (not timed)."""

import json

import pytest
from click.testing import CliRunner
from distributed import run_ranks

from titan_audit.bench import reduce_suite
from titan_audit.cli.main import cli


@pytest.mark.slow
def test_bench_reduce_json_schema(monkeypatch):
    monkeypatch.setattr(reduce_suite, "run_local_ranks", run_ranks)  # ranks forked, not spawned
    result = CliRunner().invoke(cli, ["bench", "reduce", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [c["case"] for c in data["cases"]] == [
        "reduce W=2 V=8 1MB",
        "reduce W=4 V=8 1MB",
        "TP partials W=2 256x768 f32",
        "TP partials W=4 256x768 f32",
    ]
    assert all(c["ratio"] > 0 and c["target"] == 1.25 for c in data["cases"])
