"""`bench hash --json` follows DESIGN.md section 6's schema (a smoke run; no timing asserted), with
the sharded-digest case: both designs timed and the bytes each must move between ranks."""

import json
import math

from click.testing import CliRunner

from titan_audit.cli.main import cli

CASE_KEYS = {"case", "baseline", "candidate", "baseline_s", "candidate_s", "ratio", "target"}


def test_bench_hash_json_schema():
    result = CliRunner().invoke(cli, ["bench", "hash", "--quick", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["suite"] == "hash"
    assert data["machine"]["torch_version"]
    assert len(data["cases"]) == 5
    for case in data["cases"]:
        assert CASE_KEYS <= set(case)
        assert math.isclose(case["ratio"], case["candidate_s"] / case["baseline_s"])
    for case in data["cases"][:4]:
        assert case["sha256_s"] > 0
    assert {"geomean_ratio", "max_ratio"} <= set(data["summary"])
    assert data["cases"][3]["case"].startswith("fingerprint_many state_dict")
    sharded = data["cases"][4]
    assert sharded["case"] == "sharded digest 4MB" and sharded["target"] is None
    assert sharded["chunked_xxh3_s"] > 0 and sharded["lattice_numpy_s"] > 0 and sharded["lattice_threads_s"] > 0
    assert sharded["lattice_bytes_moved_tp4_dim1"] == sharded["lattice_bytes_moved_fsdp4"] == 3 * 16
    # a dim-1 shard over 4 ranks: every chunk straddles them, 3/4 of the bytes move; FSDP2's
    # uneven dim-0 chunks (257 rows of 16 KiB) cut 3 chunks
    assert sharded["bytes"] == 257 * 4096 * 4
    assert sharded["chunked_xxh3_bytes_moved_tp4_dim1"] == sharded["bytes"] * 3 // 4
    assert 0 < sharded["chunked_xxh3_bytes_moved_fsdp4"] <= 3 * (1 << 19)


def test_unknown_suite_is_a_usage_error():
    result = CliRunner().invoke(cli, ["bench", "no-such-suite"])
    assert result.exit_code == 2 and "no-such-suite" in result.output
