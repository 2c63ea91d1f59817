"""`titan-audit data prepare` of a bad text/JSON file: exit 2, one line naming the file and the line
(and the byte, for one that is not UTF-8), wherever in the file and in whichever unit it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from titan_audit.cli.main import cli
from titan_audit.data import sources as sources_module
from titan_audit.data.state import LoaderState
from titan_audit.data.textio import decode_utf8, line_number


def _good(i: int) -> bytes:
    return (json.dumps({"text": f"document number {i}"}) + "\n").encode()


def _corpus(path: Path, bad: dict[int, bytes], lines: int = 6) -> Path:
    """A JSONL file of `lines` good lines, line N (1-based) replaced by bad[N]."""
    path.write_bytes(b"".join(bad.get(n, _good(n)) for n in range(1, lines + 1)))
    return path


def _prepare_error(tmp_path: Path, *args: object) -> str:
    out = ["--out", str(tmp_path / "out.zarr"), "--json"]  # --json: no progress bar on stderr
    result = CliRunner().invoke(cli, ["data", "prepare", *map(str, args), *out])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert not (tmp_path / "out.zarr").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.zarr.")], "nothing left behind"
    return lines[0]


LATIN1 = '{"text": "caf\xe9 au lait"}\n'.encode("latin-1")  # 0xe9 is byte 14 of the line: column 14


@pytest.mark.parametrize("line", [1, 3])  # line 1: checked when the source opens; line 3: when read
def test_a_latin1_byte_is_named_by_file_line_column_and_offset(tmp_path: Path, line: int) -> None:
    path = _corpus(tmp_path / "corpus.jsonl", {line: LATIN1})
    offset = sum(len(_good(n)) for n in range(1, line)) + 13
    message = _prepare_error(tmp_path, path)
    assert message == f"Error: {path}:{line}: not UTF-8 (byte 0xe9 at column 14, offset {offset} in the file)"
    assert path.read_bytes()[offset] == 0xE9


def test_invalid_json_and_a_missing_or_wrong_text_field_name_the_line(tmp_path: Path) -> None:
    bad_json = _corpus(tmp_path / "a.jsonl", {5: b'{"text": "unterminated\n'})
    assert _prepare_error(tmp_path, bad_json).startswith(
        f"Error: {bad_json}:5: not valid JSON (Unterminated string starting at: column 10)"
    )
    missing = _corpus(tmp_path / "b.jsonl", {4: b'{"body": "x"}\n'})
    assert _prepare_error(tmp_path, missing) == f"Error: {missing}:4: no key 'text' in the record"
    wrong = _corpus(tmp_path / "c.jsonl", {2: b'{"text": 7}\n'})
    assert _prepare_error(tmp_path, wrong) == f"Error: {wrong}:2: 'text' is int, expected a string"
    other_key = _corpus(tmp_path / "d.jsonl", {3: b'{"text": "x"}\n'})
    assert (
        _prepare_error(tmp_path, other_key, "--text-column", "body")
        == f"Error: {other_key}:1: no key 'body' in the record"
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_the_line_number_counts_from_the_start_of_the_file_in_every_unit(tmp_path: Path, monkeypatch, workers) -> None:
    monkeypatch.setattr(sources_module, "JSONL_SPLIT_BYTES", 200)  # units are cut in this process
    path = _corpus(tmp_path / "big.jsonl", {57: b"{broken\r\n", 80: LATIN1}, lines=100)
    assert len(sources_module.open_text_source(path).units()) > 5
    message = _prepare_error(tmp_path, path, "--workers", workers)
    assert message.startswith(
        f"Error: {path}:57: not valid JSON (Expecting property name enclosed in double quotes: column 2)"
    ), message  # the first one


def test_blank_lines_crlf_and_a_leading_bom_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + _good(1).replace(b"\n", b"\r\n")
        + b"\n   \n"
        + _good(2)
        + LATIN1.replace(b"\xe9", b"\xc3\xa9")
    )
    result = CliRunner().invoke(cli, ["data", "prepare", str(path), "--out", str(tmp_path / "ok.zarr"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_docs"] == 3


def test_tokenizer_and_loader_state_files_name_the_bad_line(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(b'{\n "model": {\n  "vocab": {"caf\xe9": 1}\n }\n}\n')
    source = _corpus(tmp_path / "corpus.jsonl", {})
    assert _prepare_error(tmp_path, source, "--tokenizer", tokenizer) == (
        f"Error: {tokenizer}:3: not UTF-8 (byte 0xe9 at column 17, offset 30 in the file)"
    )
    state = tmp_path / "state.json"
    state.write_bytes(b'{\n "epoch": 0,\n "step": \n}\n')
    with pytest.raises(ValueError, match=rf"^{state}:4: not valid JSON \(Expecting value: column 1\)$"):
        LoaderState.load(state)
    state.write_bytes(b'{"epoch": "\xff"}')
    with pytest.raises(ValueError, match=rf"^{state}:1: not UTF-8 \(byte 0xff at column 12, offset 11 in the file\)$"):
        LoaderState.load(state)


def test_textio_helpers(tmp_path: Path) -> None:
    assert decode_utf8(b"\xef\xbb\xbfab\ncd", "f") == "ab\ncd"
    with pytest.raises(ValueError, match=r"^f:2: not UTF-8 \(byte 0xe9 at column 2, offset 7 in the file\)$"):
        decode_utf8(b"\xef\xbb\xbfab\nc\xe9d", "f")
    path = tmp_path / "lines"
    path.write_bytes(b"a\nb\n\nc")
    assert [line_number(path, o) for o in (0, 1, 2, 4, 5, 6)] == [1, 1, 2, 3, 4, 4]
