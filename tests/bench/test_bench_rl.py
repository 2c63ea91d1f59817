"""`bench rl --quick --repeats 1 --json`: the schema and the phase keys (not timed)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from titan_audit.cli.main import cli

PHASES = ("generate", "reward", "logprobs", "backward", "optimizer")


def test_bench_rl_quick_json_has_phases():
    result = CliRunner().invoke(cli, ["bench", "rl", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "rl" and set(data["summary"]) >= {"geomean_ratio", "targets", "missed"}
    first = data["cases"][0]
    assert (first["case"], first["baseline"], first["candidate"]) == ("rl rl-tiny W=1", "native ops", "BI mode")
    for side in ("baseline", "candidate"):
        assert first[f"{side}_s"] > 0
        for phase in PHASES:
            assert first[f"{side}_seconds_{phase}"] >= 0
    assert [s["case"] for s in first["skipped"]] == ["rl rl-tiny W=1 vs TRL"]
    assert "not implemented" in first["skipped"][0]["reason"] and len(data["cases"]) == 1  # no fake figure
