"""Running `titan-audit` in tests: `cli(*args, env={...})` in a fresh process, for runs that compute
(each starts from a clean interpreter, as a user's shell would), and `cli_here(*args)` in this
process, for bad input that fails before any compute. Both return a CompletedProcess (text)."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_audit.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def cli_here(*args: str) -> subprocess.CompletedProcess:
    """`titan-audit` in this process (bad input: it fails before any compute)."""
    from click.testing import CliRunner

    from titan_audit.cli.main import cli as group

    result = CliRunner().invoke(group, [str(a) for a in args])
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)
