"""`bench --threads N` runs a suite with N intra-op threads on both sides, records N in the
machine fingerprint, and restores torch's thread count afterwards; a bad N exits 2."""

import json

import torch
from click.testing import CliRunner

from titan_audit.cli.main import cli


def test_threads_option_is_recorded_and_restored() -> None:
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    result = CliRunner().invoke(cli, ["bench", "ops", "--quick", "--repeats", "1", "--threads", str(other), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["machine"]["num_threads"] == other
    assert torch.get_num_threads() == before


def test_bad_thread_count_exits_2() -> None:
    result = CliRunner().invoke(cli, ["bench", "hash", "--quick", "--threads", "0"])
    assert result.exit_code == 2 and "threads must be >= 1, got 0" in result.output
    assert "Traceback" not in result.output
