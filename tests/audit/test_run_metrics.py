"""RUN/metrics.parquet as a directory of chunks (audit/run_metrics.py): appended, never rewritten
whole; one reader for chunks, single files and a move interrupted by a crash.

Proves: opening a run reads its last chunk only (a resume's truncation the chunks it cuts); a
flush rewrites only the last chunk (every full chunk keeps its inode: control, the
chunk a resume cuts back is rewritten, and its inode changes); the bytes written over a run grow
linearly (each flush at most CHUNK rows); a resume's truncation drops exactly the rows after its
checkpoint; a single-file metrics.parquet (runs and goldens written before the chunks) reads as it
is and moves into chunks once, its values bit for bit, also after a kill between the two renames;
pyarrow reads the directory as one table too.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_audit.audit import run_metrics
from titan_audit.audit.run_metrics import METRICS, MetricsLog, chunk_files, read_metrics


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step + math.ulp(1.0) * (step % 3), "tokens": 64 * step, "note": None}


def _inodes(run) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in chunk_files(run)}


def _bits(table: pa.Table, column: str) -> list[int]:
    return table[column].to_numpy(zero_copy_only=False).view(np.uint64).tolist()


@pytest.fixture
def chunk4(monkeypatch):
    monkeypatch.setattr(run_metrics, "CHUNK", 4)


def test_a_flush_rewrites_only_the_last_chunk(tmp_path, chunk4, monkeypatch):
    written = []
    real = run_metrics.write_bytes_atomic
    monkeypatch.setattr(run_metrics, "write_bytes_atomic", lambda p, d, **k: (written.append(len(d)), real(p, d, **k)))
    log = MetricsLog(tmp_path)
    full: dict[str, int] = {}
    for step in range(1, 15):
        log.append(_row(step))
        log.flush()
        inodes = _inodes(tmp_path)
        for name, inode in full.items():
            assert inodes[name] == inode, f"the full chunk {name} was rewritten at step {step}"
        full = {name: inodes[name] for name in sorted(inodes)[: (step // 4)]}
    assert [p.name for p in chunk_files(tmp_path)] == [f"part-{k:08d}.parquet" for k in range(4)]
    assert len(written) == 14 and max(written) < 3 * min(written)  # one file of <= 4 rows per flush
    assert read_metrics(tmp_path)["step"].to_pylist() == list(range(1, 15))
    # control: a resume from step 5 cuts chunk 1 back: it is rewritten (another inode), 2 and 3 go
    before = _inodes(tmp_path)
    again = MetricsLog(tmp_path)
    again.truncate_after(5)
    again.flush()
    after = _inodes(tmp_path)
    assert list(after) == ["part-00000000.parquet", "part-00000001.parquet"]
    assert after["part-00000000.parquet"] == before["part-00000000.parquet"]
    assert after["part-00000001.parquet"] != before["part-00000001.parquet"]
    assert read_metrics(tmp_path)["step"].to_pylist() == [1, 2, 3, 4, 5]


def test_resume_keeps_the_rows_up_to_the_checkpoint_and_appends(tmp_path, chunk4):
    log = MetricsLog(tmp_path)
    for step in range(1, 11):
        log.append(_row(step))
    log.flush()
    resumed = MetricsLog(tmp_path)
    assert [r["step"] for r in resumed.rows] == list(range(1, 11))
    resumed.truncate_after(8)
    assert [r["step"] for r in resumed.rows] == list(range(1, 9))
    for step in range(9, 13):
        resumed.append(_row(step))
        resumed.flush()
    table = read_metrics(tmp_path)
    assert table["step"].to_pylist() == list(range(1, 13))
    assert _bits(table, "loss") == _bits(pa.Table.from_pylist([_row(s) for s in range(1, 13)]), "loss")
    assert pq.read_table(tmp_path / METRICS).sort_by("step").equals(table)  # pyarrow reads the directory too


def test_opening_a_long_run_reads_its_last_chunk_only(tmp_path, chunk4, monkeypatch):
    log = MetricsLog(tmp_path)
    for step in range(1, 41):
        log.append(_row(step))
        log.flush()
    reads = []
    real = run_metrics._read_file
    monkeypatch.setattr(run_metrics, "_read_file", lambda path: (reads.append(path.name), real(path))[1])
    resumed = MetricsLog(tmp_path)
    assert reads == ["part-00000009.parquet"] and len(resumed.rows) == 40
    resumed.truncate_after(37)  # inside the last chunk (steps 37..40): nothing more read
    assert len(reads) == 1 and resumed.rows[-1]["step"] == 37
    resumed.truncate_after(30)  # back into chunks 8 and 7 (steps 33..36, 29..32)
    assert reads[1:] == ["part-00000008.parquet", "part-00000007.parquet"] and len(resumed.rows) == 30
    assert [row["step"] for row in resumed.rows] == list(range(1, 31))  # iterating reads the rest
    resumed.flush()
    assert read_metrics(tmp_path)["step"].to_pylist() == list(range(1, 31))
    assert [p.name for p in chunk_files(tmp_path)] == [f"part-{k:08d}.parquet" for k in range(8)]


def test_nothing_is_written_without_rows(tmp_path):
    MetricsLog(tmp_path).flush()
    assert not (tmp_path / METRICS).exists() and read_metrics(tmp_path) is None


def test_a_single_file_run_reads_as_is_and_moves_into_chunks_once(tmp_path, chunk4):
    rows = [_row(s) for s in range(1, 11)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / METRICS)  # a run written before the chunks
    single = read_metrics(tmp_path)
    assert single["step"].to_pylist() == list(range(1, 11))
    log = MetricsLog(tmp_path)
    assert (tmp_path / METRICS).is_dir() and len(chunk_files(tmp_path)) == 3
    assert not any(p.name.startswith(".metrics") for p in tmp_path.iterdir())
    moved = read_metrics(tmp_path)
    assert moved.column_names == single.column_names
    assert _bits(moved, "loss") == _bits(single, "loss") and moved["tokens"].equals(single["tokens"])
    assert list(log.rows) == rows


def test_a_kill_between_the_renames_loses_nothing(tmp_path, chunk4):
    rows = [_row(s) for s in range(1, 7)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / ".metrics.parquet.v1")  # moved aside ...
    (tmp_path / ".metrics.parquet.chunks").mkdir()  # ... and the chunks half built
    assert read_metrics(tmp_path)["step"].to_pylist() == list(range(1, 7))
    log = MetricsLog(tmp_path)
    assert list(log.rows) == rows and [p.name for p in tmp_path.iterdir()] == [METRICS]
    assert read_metrics(tmp_path)["step"].to_pylist() == list(range(1, 7))


def test_a_column_null_in_one_chunk_takes_its_type_from_another(tmp_path, chunk4):
    log = MetricsLog(tmp_path)
    for step in range(1, 7):
        log.append({**_row(step), "note": None if step <= 4 else float(step)})
    log.flush()
    assert pq.read_schema(chunk_files(tmp_path)[0]).field("note").type == pa.null()
    table = read_metrics(tmp_path)
    assert table.schema.field("note").type == pa.float64()
    assert table["note"].to_pylist() == [None] * 4 + [5.0, 6.0]


def test_bad_metrics_are_named(tmp_path, chunk4):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.append(_row(step))
    log.flush()
    chunk = chunk_files(tmp_path)[1]
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"^{chunk}: not a readable Parquet file"):
        read_metrics(tmp_path)
    pq.write_table(pa.table({"loss": [1.0]}), tmp_path / "other.parquet")
    (tmp_path / "other").mkdir()
    (tmp_path / "other.parquet").rename(tmp_path / "other" / METRICS)
    with pytest.raises(ValueError, match="no 'step' column"):
        read_metrics(tmp_path / "other")
