"""Reading the user's text and JSON files: a bad byte or a bad line is named by file and line.

Guarantees (every error is a ValueError, one line, starting `NAME:LINE:` like a compiler's):
- `decode_utf8(data, name)`: the text, or `NAME:LINE: not UTF-8 (byte 0xE9 at column 17, offset
  123 in the file)`; column and offset count bytes from 1 and 0. A leading UTF-8 BOM is dropped.
- `load_json(data, name)`: the object, or the UTF-8 error above, or `NAME:LINE: not valid JSON
  (MSG: column C)`.
- `line_number(path, offset)`: the 1-based line (counting b"\\n") of byte `offset` of a file, read
  in blocks: for the error path of a reader that only knows a byte range.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any

__all__ = ["decode_utf8", "line_number", "load_json", "not_utf8"]


def not_utf8(line: bytes, error: UnicodeDecodeError, offset: int | None = None) -> str:
    """What is wrong with `line` (the bytes of one line) where it failed to decode; `offset`: the
    line's byte offset in its file, when known."""
    where = f", offset {offset + error.start} in the file" if offset is not None else ""
    return f"not UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1}{where})"


def decode_utf8(data: bytes, name: str | os.PathLike) -> str:
    """`data` (a whole file's bytes) as text; ValueError naming the line of a bad byte."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
        skipped = len(codecs.BOM_UTF8)
    else:
        skipped = 0
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        start = data.rfind(b"\n", 0, error.start) + 1
        end = data.find(b"\n", error.start)
        line = data[start : end if end >= 0 else len(data)]
        local = UnicodeDecodeError(error.encoding, line, error.start - start, error.end - start, error.reason)
        number = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{os.fspath(name)}:{number}: {not_utf8(line, local, start + skipped)}") from None


def load_json(data: bytes, name: str | os.PathLike) -> Any:
    """`data` (a whole JSON file's bytes) parsed; ValueError naming the line at fault."""
    text = decode_utf8(data, name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{os.fspath(name)}:{error.lineno}: not valid JSON ({error.msg}: column {error.colno})"
        ) from None


def line_number(path: str | os.PathLike, offset: int) -> int:
    """The 1-based line of byte `offset` of the file at `path`."""
    count = 0
    with open(path, "rb") as f:
        remaining = offset
        while remaining > 0:
            block = f.read(min(remaining, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count + 1
