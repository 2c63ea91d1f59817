"""Running `titan-audit` in tests: `cli(*args, env={...})` in a fresh process, for runs that compute
(each starts from a clean interpreter, as a user's shell would), and `cli_here(*args)` in this
process, for bad input that fails before any compute. Both return a CompletedProcess (text);
`one_line_error(proc, pattern)` asserts the user-error shape: exit 2, one `Error: ...` line."""

from __future__ import annotations

import os
import re
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


def one_line_error(proc: subprocess.CompletedProcess, pattern: str, *, ignore: tuple[str, ...] = ()) -> str:
    """Exit 2 with one line on stderr, `Error: ...`, matching the regex `pattern` (lines starting
    with an `ignore` prefix, a library's own noise, left out); the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not (ignore and line.startswith(ignore))]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]
