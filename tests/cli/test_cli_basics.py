"""The CLI's contract: help lists every command, bad usage exits 2 with one line and no traceback."""

import json
import subprocess
import sys

from click.testing import CliRunner

from titan_audit import __version__
from titan_audit.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, list(args))


def test_help_lists_every_command_with_a_description():
    result = _run("--help")
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1].strip().splitlines()
    listed = {line.split()[0]: " ".join(line.split()[1:]) for line in commands}
    assert set(cli.list_commands(None)) == set(listed)
    assert all(listed.values()), listed


def test_version():
    result = _run("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_unknown_command_and_option_exit_2_without_traceback():
    for args in (["no-such-command"], ["env", "--no-such-option"]):
        proc = subprocess.run([sys.executable, "-m", "titan_audit.cli", *args], capture_output=True, text=True)
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert "Error:" in proc.stderr and "Usage:" in proc.stderr


def test_env_json_is_one_object_with_the_fingerprint_keys():
    result = _run("env", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert {"torch_version", "device_kind", "cpu_capability", "blas", "num_threads", "env"} <= set(data)


def test_env_human_output_names_the_fields():
    result = _run("env")
    assert result.exit_code == 0 and "torch_version" in result.output


def test_env_against_compatible_and_incompatible_files(tmp_path):
    here = json.loads(_run("env", "--json").stdout)
    same = tmp_path / "same.json"
    same.write_text(json.dumps(here))
    assert _run("env", "--against", str(same)).exit_code == 0

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**here, "torch_version": "1.0.0"}))
    result = _run("env", "--against", str(other), "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["compatible"] is False and any("torch_version" in r for r in data["reasons"])


def test_env_against_bad_files_exit_2_naming_the_file(tmp_path):
    missing = tmp_path / "missing.json"
    result = _run("env", "--against", str(missing))
    assert result.exit_code == 2 and "missing.json" in result.output
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = _run("env", "--against", str(broken))
    assert result.exit_code == 2 and "broken.json" in result.output and "not valid JSON" in result.output
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"fingerprint_version": 99}))
    result = _run("env", "--against", str(newer))
    assert result.exit_code == 2 and "newer" in result.output
