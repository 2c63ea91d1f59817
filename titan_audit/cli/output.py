"""Printing helpers shared by commands: JSON on stdout, human tables via rich."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def print_mapping(title: str, mapping: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in mapping.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None) or "-"
        elif isinstance(value, (list, tuple)):
            value = " ".join(map(str, value))
        table.add_row(key, str(value))
    Console().print(table)
