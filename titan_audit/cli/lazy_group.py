"""A click group whose subcommands are imported only when one of them is run (or asked for help).

    @click.group(cls=LazyGroup, lazy={"train": ("titan_audit.cli.train:train", "Train; ...")})

Guarantees:
- `lazy` maps a command name to ("module:attribute", short help). The group's --help lists every
  command with that short help without importing any command module; `GROUP NAME ...` (and
  `GROUP NAME --help`) imports NAME's module alone. So `titan-audit --help` imports neither torch
  nor any command, and a command's start-up costs only what that command needs.
- The short help in the table is the command's own (`short_help=` on the command); the CLI tests
  compare the two for every command, so the listing cannot drift from the commands.
- Error handling is AuditGroup's (cli/errors.py): one line, exit 2 for bad input.
"""

from __future__ import annotations

import importlib

import click

from titan_audit.cli.errors import AuditGroup


class LazyGroup(AuditGroup):
    """AuditGroup with commands imported on first use (see the module docstring)."""

    def __init__(self, *args, lazy: dict[str, tuple[str, str]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            target, _ = self.lazy[cmd_name]
            module, _, attribute = target.partition(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command), f"{target} is not a click command"
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of --help, from the table for commands not imported yet."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            if command is not None:
                if command.hidden:
                    continue
                rows.append((name, command.get_short_help_str(formatter.width - 6 - len(name))))
            else:
                rows.append((name, self.lazy[name][1]))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
