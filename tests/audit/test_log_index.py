"""The audit log's index and what checking the log costs (audit/log.py, audit/log_index.py).

Proves: every committed part is indexed with the xxh3-128 digest of its bytes, in files of bounded
size; a resume's check (`check_audit_log`) of a 10^5-step log reads the same parts and about the
same bytes as that of a 20-step log (counted, not timed: `bench audit` times it), reads each part
once however many checks follow (the launcher's, rank 0's, every writer's), indexes a part a crash
left after the index, and reads a run without an index in full once, building it. Controls: a
part corrupted after the checkpoint a resume starts from (or the part it appends to) stops the
check, named; an older corrupted part is not read by it and is found by `titan-audit verify`
(exit 1), as is a change the Parquet page checksums cannot see (the footer), a part missing from
the index's list, and a damaged index file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from titan_audit.audit import log_index
from titan_audit.audit.log import (
    AuditLogWriter,
    audit_dir,
    check_audit_log,
    encode_part,
    part_files,
    read_audit_log,
    verify_log,
    verify_part,
)
from titan_audit.audit.log_index import RankIndex, index_dir, part_name
from titan_audit.bench.audit_suite import CRASH_AFTER, INTERVAL, generated_log, records_table
from titan_audit.cli.main import cli

LONG = 10**5


def _flip_data_byte(part: Path) -> None:
    """Flip one byte inside the first column chunk's data (what the page checksums cover)."""
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(part.read_bytes())
    data[start + chunk.total_compressed_size - 4] ^= 0x01
    part.write_bytes(bytes(data))


def _flip_footer_byte(part: Path) -> None:
    """Change one letter of the writer's name in the footer: still a valid Parquet file with the
    same records, and no page checksum covers it; only the digest in the index sees it."""
    data = part.read_bytes()
    at = data.rindex(b"parquet-cpp")
    part.write_bytes(data[:at] + b"P" + data[at + 1 :])


def _verify_cli(run: Path, *args: str):
    return CliRunner().invoke(cli, ["verify", str(run), *args])


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Rank 0's audit logs of two runs killed CRASH_AFTER steps after a checkpoint: at 20 and at 10^5."""
    root = tmp_path_factory.mktemp("logs")
    return {name: (root / name, generated_log(root / name, step)) for name, step in (("short", 20), ("long", LONG))}


def test_the_resume_check_of_a_long_log_reads_what_a_short_ones_does(logs, tmp_path):
    (short, s_step), (long, l_step) = logs["short"], logs["long"]
    assert len(part_files(long)) == LONG // INTERVAL + 1 and len(part_files(short)) == 2
    a = check_audit_log(short, after_step=s_step, mark=False)
    b = check_audit_log(long, after_step=l_step, mark=False)
    # the part after the checkpoint and the checkpoint's own: the same parts, the same records
    assert a.parts_verified == b.parts_verified == 2
    assert b.bytes_read <= 1.2 * a.bytes_read
    # the index: a head and at most one sealed segment, whatever the length
    assert b.index_bytes_read <= 2 * (log_index.SEGMENT + 1) * 200
    assert not a.legacy and not b.legacy and a.parts_indexed == b.parts_indexed == 0
    # control: an older part of the long log corrupted is not read by the check (its cost) ...
    old = audit_dir(long) / part_name(0, 100)
    saved = old.read_bytes()
    _flip_data_byte(old)
    try:
        assert check_audit_log(long, after_step=l_step, mark=False).parts_verified == 2
        with pytest.raises(ValueError, match=f"^{old}: unreadable"):
            verify_part(old)  # ... and it is damaged (verify_log finds it: test below, on a smaller log)
    finally:
        old.write_bytes(saved)
    # control: the part after the checkpoint corrupted stops the check, named
    tail = part_files(long)[-1]
    saved = tail.read_bytes()
    _flip_data_byte(tail)
    try:
        with pytest.raises(ValueError, match=f"^{tail}: unreadable .*damaged"):
            check_audit_log(long, after_step=l_step, mark=False)
    finally:
        tail.write_bytes(saved)


@pytest.fixture
def run(tmp_path) -> tuple[Path, int]:
    """A log of 100 parts (killed 25 steps after its checkpoint at step 2000)."""
    return tmp_path / "run", generated_log(tmp_path / "run", 2000)


def test_verify_finds_an_older_corrupted_part_the_resume_check_leaves_to_its_digest(run):
    path, step = run
    ok = _verify_cli(path, "--json")
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert list(data) == ["run", "ok", "parts", "records", "bytes", "indexed", "unindexed", "problems"]
    assert data["ok"] and data["parts"] == 101 and data["records"] == 101 * INTERVAL * 12 and data["indexed"]
    old = part_files(path)[7]
    _flip_data_byte(old)
    assert check_audit_log(path, after_step=step).parts_verified == 2  # not read: it stands on its digest
    result = _verify_cli(path)
    assert result.exit_code == 1 and f"{old}: unreadable (" in result.output, result.output
    assert "1 problem(s)" in result.output


def test_a_change_no_page_checksum_covers_is_found_by_the_digest(run):
    path, _ = run
    part = part_files(path)[3]
    _flip_footer_byte(part)
    verify_part(part)  # still a readable part with intact pages: only the digest tells
    result = verify_log(path)
    assert not result.ok and len(result.problems) == 1
    assert result.problems[0].startswith(f"{part}: unreadable (") and "the index holds" in result.problems[0]


@pytest.mark.parametrize("which", ["after the checkpoint", "appended to"])
def test_a_corrupted_part_since_the_checkpoint_stops_the_resume(run, which):
    path, step = run
    after, at = part_files(path)[-1], part_files(path)[-2]  # steps past `step`; the checkpoint's part
    assert read_audit_log(path, columns=["step"])["step"].to_pylist()[-1] == step + INTERVAL
    part = after if which == "after the checkpoint" else at
    assert check_audit_log(path, after_step=step, mark=False).parts_verified == 2  # control: intact, it passes
    _flip_data_byte(part)
    with pytest.raises(ValueError, match=f"^{part}: unreadable .*the audit log of this run is damaged"):
        check_audit_log(path, after_step=step)


def test_each_part_is_read_back_once_whatever_checks_follow(run):
    path, step = run
    first = check_audit_log(path, after_step=step)  # the launcher's
    assert first.parts_verified == 2
    assert check_audit_log(path, after_step=step).parts_verified == 0  # rank 0's, again
    writer = AuditLogWriter(path, rank=0, verify=True)  # a recorder's
    assert writer.check.parts_verified == 0
    assert AuditLogWriter(path, rank=1, verify=True).check.parts_verified == 0  # a rank new to the run
    writer.write(records_table(step + INTERVAL + 1, INTERVAL, 12).to_pydict())
    # the new part is read back by the next writer: it is what that writer appends to
    assert AuditLogWriter(path, rank=0, verify=True).check.parts_verified == 1
    assert AuditLogWriter(path, rank=0, verify=True).check.parts_verified == 0


def test_a_part_committed_after_the_index_is_read_and_indexed(run):
    path, step = run
    head = RankIndex.load(audit_dir(path), 0)
    nxt = head.next_part()
    data, _ = encode_part(records_table(step + CRASH_AFTER, 1, 12), nxt)
    (audit_dir(path) / part_name(0, nxt)).write_bytes(data)  # a kill between the rename and the index write
    assert verify_log(path).unindexed == [str(audit_dir(path) / part_name(0, nxt))]
    check = check_audit_log(path, after_step=step)
    assert check.parts_indexed == 1 and check.parts_verified == 3
    assert RankIndex.load(audit_dir(path), 0).next_part() == nxt + 1
    result = verify_log(path)
    assert result.ok and not result.unindexed
    assert AuditLogWriter(path).next_part == nxt + 1  # numbered on, nothing overwritten


def test_a_run_without_an_index_is_read_once_and_indexed(run):
    path, step = run
    shutil.rmtree(index_dir(audit_dir(path)))  # a run written before the index
    legacy = verify_log(path)
    assert legacy.ok and not legacy.indexed and legacy.parts == 101
    assert check_audit_log(path, after_step=step, mark=False).parts_verified == 101  # read-only: builds nothing
    assert not index_dir(audit_dir(path)).exists()
    first = check_audit_log(path, after_step=step)
    assert first.legacy and first.parts_verified == first.parts_indexed == 101
    assert check_audit_log(path, after_step=step).parts_verified == 0
    result = verify_log(path)
    assert result.ok and result.indexed and result.parts == 101 and not result.unindexed


def test_a_legacy_run_opened_by_a_writer_numbers_on(run):
    path, _ = run
    shutil.rmtree(index_dir(audit_dir(path)))
    writer = AuditLogWriter(path, rank=0)
    assert writer.check.legacy and writer.check.parts_verified == 101 and writer.next_part == 101


def test_segments_seal_and_the_head_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(log_index, "SEGMENT", 4)
    writer = AuditLogWriter(tmp_path)
    for k in range(11):
        writer.write(records_table(k + 1, 1, 2).to_pydict())
    index = RankIndex.load(audit_dir(tmp_path), 0)
    assert index.sealed == 2 and [e.part for e in index.head] == [8, 9, 10]
    assert [e.part for e in index.all_entries()] == list(range(11))
    assert [e.part for e in index.newest_first()] == list(range(10, -1, -1))
    for entry, part in zip(index.all_entries(), part_files(tmp_path)):
        data = part.read_bytes()
        assert (entry.bytes, entry.first_step, entry.last_step) == (len(data), entry.part + 1, entry.part + 1)
    assert verify_log(tmp_path).ok
    # part k holds step k + 1: a check reads the parts past the checkpoint's step and the one
    # holding it, walking back into sealed segments only as far as that
    checks = [check_audit_log(tmp_path, after_step=s, mark=False) for s in (9, 6, 2)]
    assert [c.parts_verified for c in checks] == [3, 6, 10]
    head = len(index.path.read_bytes())
    assert checks[0].index_bytes_read == head < checks[1].index_bytes_read < checks[2].index_bytes_read


def test_index_problems_are_named(run):
    path, step = run
    missing = part_files(path)[10]
    missing.rename(missing.with_name("moved-out"))
    result = verify_log(path)
    assert len(result.problems) == 1
    assert result.problems[0].startswith(f"{missing}: unreadable (missing, though listed in the index); ")
    head = RankIndex.load(audit_dir(path), 0).path
    head.write_text("{not json")
    with pytest.raises(ValueError, match=f"^{head}: the audit log's index is damaged"):
        check_audit_log(path, after_step=step)
    assert any(p.startswith(f"{head}: the audit log's index is damaged") for p in verify_log(path).problems)


def test_verify_of_a_missing_run_or_a_run_without_an_audit_log_exits_2(tmp_path):
    for target, needle in ((tmp_path / "nope", "no such run directory"), (tmp_path, "audit/ not found")):
        result = _verify_cli(target)
        assert result.exit_code == 2 and needle in result.stderr, result.output
