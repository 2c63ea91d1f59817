"""Sources and manifests: Parquet by row group, JSONL by line ranges, bad input named, changes caught."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_audit.data import check_unchanged, open_text_source
from titan_audit.data import sources as sources_module
from titan_audit.data.sources import read_unit


def _parquet(path, texts, row_group_size=2, column="text"):
    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def _bytes(path, data):
    path.write_bytes(data)
    return path


def _jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "i": i}) + "\n" for i, t in enumerate(texts)))
    return path


TEXTS = ["alpha", "", "gamma delta", "é ü 漢字", "x" * 50, "last"]


def _all_texts(source):
    return [t for unit in source.units() for t in read_unit(unit, source.text_column)]


def test_parquet_is_read_by_row_group_in_order(tmp_path):
    source = open_text_source(_parquet(tmp_path / "a.parquet", TEXTS, row_group_size=2))
    units = source.units()
    assert [u.index for u in units] == [0, 1, 2]
    assert _all_texts(source) == TEXTS
    manifest = source.manifest()
    assert [(e.name, e.rows) for e in manifest.entries] == [("a.parquet", 6)]


def test_jsonl_splits_cover_every_line_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "JSONL_SPLIT_BYTES", 30)
    texts = [f"line {i} " + "y" * (i % 7) for i in range(40)]
    source = open_text_source(_jsonl(tmp_path / "a.jsonl", texts))
    assert len(source.units()) > 5
    assert _all_texts(source) == texts
    assert source.manifest().entries[0].rows == 40


def test_directory_sources_are_sorted_by_relative_path(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    _parquet(tmp_path / "d" / "sub" / "b.parquet", ["b1", "b2"])
    _parquet(tmp_path / "d" / "a.parquet", ["a1"])
    source = open_text_source(tmp_path / "d")
    assert [n for n, _ in source.files] == ["a.parquet", "sub/b.parquet"]
    assert _all_texts(source) == ["a1", "b1", "b2"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: d / "missing.parquet", r"missing\.parquet: no such file"),
        (
            lambda d: _parquet(d / "w.parquet", ["a"], column="body"),
            r"w\.parquet: no text column 'text' \(columns: body, n\)",
        ),
        (lambda d: _bytes(d / "e.parquet", b""), r"e\.parquet: empty file"),
        (lambda d: _bytes(d / "c.parquet", b"PAR1 this is not parquet"), r"c\.parquet: not a readable Parquet"),
        (
            lambda d: _bytes(d / "t.parquet", _parquet(d / "full.parquet", TEXTS).read_bytes()[:-30]),
            r"t\.parquet: not a readable Parquet",
        ),
        (lambda d: _parquet(d / "z.parquet", pa.array([], pa.string())), r"z\.parquet: empty file \(0 rows\)"),
        (lambda d: _parquet(d / "i.parquet", [1, 2]), r"i\.parquet: column 'text' has type int64"),
        (lambda d: _bytes(d / "e.jsonl", b"\n\n"), r"e\.jsonl: empty file"),
        (lambda d: _jsonl(d / "k.jsonl", ["a"], key="body"), r"k\.jsonl:1: no key 'text'"),
        (lambda d: _bytes(d / "b.jsonl", b"{not json\n"), r"b\.jsonl:1: not valid JSON"),
        (lambda d: _bytes(d / "x.txt", b"hi"), r"x\.txt: unknown source type"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_file(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        open_text_source(make(tmp_path))


def test_null_text_and_late_bad_jsonl_lines_are_named_when_read(tmp_path):
    source = open_text_source(_parquet(tmp_path / "n.parquet", ["a", None, "c"], row_group_size=3))
    with pytest.raises(ValueError, match=r"n\.parquet row group 0: null text .* at row 1"):
        _all_texts(source)
    path = tmp_path / "late.jsonl"
    path.write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"late\.jsonl:2: 'text' is int, expected a string"):
        _all_texts(open_text_source(path))


def test_a_changed_file_is_named_and_the_override_returns_the_change(tmp_path):
    _parquet(tmp_path / "a.parquet", ["one", "two"])
    _parquet(tmp_path / "b.parquet", ["three"])
    saved = open_text_source(tmp_path).manifest()
    again = open_text_source(tmp_path).manifest()
    assert again.digest() == saved.digest()  # deterministic
    assert check_unchanged(saved.digest(), saved, again) == []
    _parquet(tmp_path / "b.parquet", ["threE"])  # same size, same rows, other bytes
    changed = open_text_source(tmp_path).manifest()
    assert changed.digest() != saved.digest()  # negative control: the digest sees it
    with pytest.raises(ValueError, match=r"b\.parquet: changed \(.*hash .*\).*allow_source_change"):
        check_unchanged(saved.digest(), saved, changed)
    diffs = check_unchanged(saved.digest(), saved, changed, allow_change=True)
    assert len(diffs) == 1 and "b.parquet" in diffs[0] and "a.parquet" not in diffs[0]
    (tmp_path / "a.parquet").unlink()
    with pytest.raises(ValueError, match=r"a\.parquet: removed"):
        check_unchanged(saved.digest(), saved, open_text_source(tmp_path).manifest())
