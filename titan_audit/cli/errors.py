"""How errors reach the terminal: one line, no traceback (unless -v).

- Bad input (ValueError and the path errors FileNotFoundError, NotADirectoryError,
  IsADirectoryError): 'Error: <message>', exit 2.
- A missing or stale build of the CPU kernels (`KernelLibraryError`) counts as one: it says what
  to run.
- A fault of the user's machine (any other OSError: a read-only directory, a full disk, too many
  open files): one line naming the path and the errno, exit 2; the traceback is saved to a log
  file next to the run it concerns, or in the system temp dir, and the line names it
  (titan_audit/faults.py).
Which errors these are is `faults.user_errors()`, the list a launch's ranks use too.
With -v the original exception propagates, traceback and all."""

from __future__ import annotations

import click

from titan_audit import faults

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2


class UserError(click.ClickException):
    """Bad input: printed as 'Error: <message>' with exit code 2."""

    exit_code = EXIT_BAD_INPUT


class AuditGroup(click.Group):
    """A click group that turns library ValueErrors (bad input) and OS faults into UserError."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except faults.user_errors() as error:
            if ctx.obj and ctx.obj.get("verbose"):
                raise
            raise UserError(faults.user_message(error)) from None
