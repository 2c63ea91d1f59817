"""The lazy command table (cli/lazy_group.py): `titan-audit --help` imports no command and no
torch, `CMD --help` imports CMD's module alone, the table's short help is each command's own, and
the group keeps AuditGroup's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import click
from click.testing import CliRunner

from titan_audit.cli.lazy_group import LazyGroup
from titan_audit.cli.main import COMMANDS, cli

# prints (exit code, torch imported?, the titan_audit.cli modules loaded) after `titan-audit ARGS`
PROBE = """
import json, sys
from titan_audit.cli.main import cli
try:
    cli(sys.argv[1:], prog_name="titan-audit")
except SystemExit as stop:
    code = stop.code
loaded = sorted(m for m in sys.modules if m.startswith("titan_audit.cli."))
print(json.dumps([code, "torch" in sys.modules, loaded]), file=sys.stderr)
"""


def probe(*args: str) -> tuple[int, bool, list[str], str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    code, torch, loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    return code, torch, loaded, proc.stdout


def command_modules() -> set[str]:
    return {target.partition(":")[0] for target, _ in COMMANDS.values()}


def test_help_lists_every_command_without_importing_any_or_torch():
    proc = subprocess.run([sys.executable, "-m", "titan_audit.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split("Commands:")[1]
    for name, (_, short) in COMMANDS.items():
        assert f"{name} " in listed and short in " ".join(listed.split()), name
    code, torch, loaded, _ = probe("--help")
    assert code == 0 and not torch, loaded
    assert not command_modules() & set(loaded), loaded


def test_a_commands_help_imports_that_command_alone():
    code, _, loaded, out = probe("compare", "--help")
    assert code == 0 and "Usage: titan-audit compare" in out
    assert command_modules() & set(loaded) == {"titan_audit.cli.compare"}, loaded


def test_every_command_help_works_and_the_table_says_its_short_help():
    runner = CliRunner()
    for name, (_, short) in COMMANDS.items():
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert cli.get_command(click.Context(cli), name).short_help == short, name
    golden = cli.get_command(click.Context(cli), "golden")
    result = runner.invoke(cli, ["golden", "kernels", "--help"])
    assert result.exit_code == 0 and "golden kernels [OPTIONS]" in result.output
    assert golden.get_command(click.Context(golden), "kernels").short_help == golden.lazy["kernels"][1]


def _boom(error: Exception) -> click.Command:
    @click.command()
    def boom() -> None:
        raise error

    return boom


def test_errors_stay_one_line_exit_2(monkeypatch):
    from titan_audit.batch_invariant.cpu import KernelLibraryError

    module = type(sys)("titan_audit_lazy_probe")
    module.value, module.kernels = _boom(ValueError("bad key x")), _boom(KernelLibraryError("kernels stale; make"))
    module.other = _boom(RuntimeError("an internal fault"))
    monkeypatch.setitem(sys.modules, "titan_audit_lazy_probe", module)
    group = LazyGroup(lazy={name: (f"titan_audit_lazy_probe:{name}", name) for name in ("value", "kernels", "other")})
    for name, message in (("value", "bad key x"), ("kernels", "kernels stale; make")):
        result = CliRunner().invoke(group, [name])
        assert result.exit_code == 2 and result.stderr.strip() == f"Error: {message}", result.output
    result = CliRunner().invoke(group, ["other"])  # control: not a user error, so not turned into one
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)
