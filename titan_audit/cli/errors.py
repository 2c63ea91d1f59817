"""How user errors reach the terminal: one line, exit code 2, no traceback (unless -v).

A missing or stale build of the CPU kernels (`KernelLibraryError`) counts as one: it says what to run."""

from __future__ import annotations

import click

from titan_audit.batch_invariant.cpu import KernelLibraryError

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2


class UserError(click.ClickException):
    """Bad input: printed as 'Error: <message>' with exit code 2."""

    exit_code = EXIT_BAD_INPUT


class AuditGroup(click.Group):
    """A click group that turns library ValueErrors (bad input) into UserError."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, KernelLibraryError) as error:
            if ctx.obj and ctx.obj.get("verbose"):
                raise
            raise UserError(str(error)) from None
