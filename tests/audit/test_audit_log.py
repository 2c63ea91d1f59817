"""Audit log: parts round-trip, per-rank names, atomic writes, readable during and after SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow.dataset as ds
import pytest

from titan_audit.audit import AuditLogWriter, read_audit_log
from titan_audit.audit.log import audit_dataset, part_files


def _columns(step: int, n: int, rank: int = 0) -> dict:
    return {
        "step": [step] * n,
        "phase": ["loss"] * n,
        "microbatch": list(range(n)),
        "name": [f"r{rank}"] * n,
        "dtype": ["float32"] * n,
        "shape": ["[]"] * n,
        "hash": [f"{step:032x}"] * n,
        "absmax": [1.0] * n,
        "mean": [0.5] * n,
        "rank": [rank] * n,
        "seq": [0] * n,
    }


def test_round_trip_and_lazy_concatenation(tmp_path):
    writer = AuditLogWriter(tmp_path, rank=0)
    for step in range(3):
        writer.write(_columns(step, 4))
    table = read_audit_log(tmp_path)
    assert table.num_rows == 12
    assert table.column("step").to_pylist() == [0] * 4 + [1] * 4 + [2] * 4
    assert table.column("hash").to_pylist()[4] == f"{1:032x}"
    filtered = read_audit_log(tmp_path, filter=ds.field("step") == 2, columns=["step", "microbatch"])
    assert filtered.to_pydict() == {"step": [2] * 4, "microbatch": [0, 1, 2, 3]}
    assert isinstance(audit_dataset(tmp_path), ds.Dataset)


def test_ranks_write_side_by_side_and_resume_appends(tmp_path):
    AuditLogWriter(tmp_path, rank=0).write(_columns(0, 2, rank=0))
    AuditLogWriter(tmp_path, rank=1).write(_columns(0, 2, rank=1))
    again = AuditLogWriter(tmp_path, rank=0)  # a resumed rank 0 numbers on, never overwrites
    again.write(_columns(1, 2, rank=0))
    assert [p.name for p in part_files(tmp_path)] == [
        "part-r00000-00000000.parquet",
        "part-r00000-00000001.parquet",
        "part-r00001-00000000.parquet",
    ]
    assert read_audit_log(tmp_path).num_rows == 6


def test_empty_write_makes_no_part_and_empty_log_reads(tmp_path):
    writer = AuditLogWriter(tmp_path)
    assert writer.write(_columns(0, 0)) is None
    assert read_audit_log(tmp_path).num_rows == 0


def test_half_written_temporary_part_is_ignored(tmp_path):
    AuditLogWriter(tmp_path).write(_columns(0, 3))
    good = part_files(tmp_path)[0]
    # what a crash mid-write leaves: a hidden temporary with part of a file's bytes
    (tmp_path / "audit" / ".part-r00000-00000001.parquet.tmp").write_bytes(good.read_bytes()[:50])
    assert read_audit_log(tmp_path).num_rows == 3
    # the next writer does not trip over it either
    AuditLogWriter(tmp_path).write(_columns(1, 2))
    assert read_audit_log(tmp_path).num_rows == 5


def test_truncated_part_is_a_user_error_naming_the_file(tmp_path):
    AuditLogWriter(tmp_path).write(_columns(0, 3))
    part = part_files(tmp_path)[0]
    part.write_bytes(part.read_bytes()[:-20])
    with pytest.raises(ValueError, match=str(part)):
        read_audit_log(tmp_path)


def test_not_a_run(tmp_path):
    with pytest.raises(ValueError, match="no such run directory"):
        read_audit_log(tmp_path / "missing")
    with pytest.raises(ValueError, match="audit/ not found"):
        read_audit_log(tmp_path)


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from titan_audit.audit import Recorder
    recorder = Recorder(sys.argv[1], level="params", flush_every_steps=1, stats=False)
    big = torch.arange(4096, dtype=torch.float32)
    step = 0
    while True:
        recorder.start_step(step)
        for i in range(200):
            recorder.record("param", f"p{i}", big + step)
        recorder.end_step()
        if step == 0:
            print("flushed", flush=True)
        step += 1
    """
)


@pytest.mark.slow
def test_sigkill_mid_write_leaves_a_readable_log(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "flushed"
        time.sleep(0.7)  # let it write more parts; the kill lands at an arbitrary point
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    parts = part_files(tmp_path)
    assert len(parts) >= 1
    table = read_audit_log(tmp_path)
    # every complete part holds one whole step of 200 records, steps 0..n-1 without gaps
    assert table.num_rows == 200 * len(parts)
    assert sorted(set(table.column("step").to_pylist())) == list(range(len(parts)))
