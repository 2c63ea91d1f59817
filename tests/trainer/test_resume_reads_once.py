"""A resume reads its audit log's tail once: the launcher's check hands what it read and found
intact (part names, sizes, digests, modification times) to the ranks through the launch options,
so rank 0's check and the writer skip those parts while they are unchanged. Counted by wrapping
the one part reader (audit.log.verify_part). Negative controls: the same resume without the
hand-over reads the newest part three times (launcher, rank 0, writer); a part changed between
the launcher's check and the rank's is read again, and a damaged one is refused."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from titan_audit.audit import log as audit_log
from titan_audit.trainer.config import load_config
from titan_audit.trainer.launch import LaunchOptions, launch, start
from titan_audit.trainer.train import TRAIN_JOB

TINY = ["steps=2", "checkpoint.interval=2", "data.synthetic_records=256"]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    assert launch(TRAIN_JOB, load_config("tiny-dense", TINY), out, nproc=None, options=LaunchOptions(quiet=True)) == 0
    return out


@pytest.fixture
def reads(monkeypatch) -> Counter:
    counts: Counter = Counter()
    reader = audit_log.verify_part

    def counting(part, entry=None):
        counts[part.name] += 1
        return reader(part, entry)

    monkeypatch.setattr(audit_log, "verify_part", counting)
    return counts


def test_a_resume_through_the_launcher_reads_each_part_once(run, reads):
    options = LaunchOptions(resume=True, quiet=True)
    assert start(TRAIN_JOB, None, run, nproc=None, steps=4, options=options) == 0
    newest = audit_log.part_files(run)[-2]  # the resume wrote one more part after the one it appends to
    assert reads[newest.name] == 1, reads
    assert reads and set(reads.values()) == {1}, reads


def test_control_without_the_hand_over_the_newest_part_is_read_three_times(run, reads):
    config = load_config("tiny-dense", [*TINY, "steps=4"])
    options = LaunchOptions(resume=True, quiet=True)
    TRAIN_JOB.check_run(config, run, 1, options)  # the launcher's check, its findings not handed on
    assert launch(TRAIN_JOB, config, run, nproc=None, options=options) == 0
    newest = audit_log.part_files(run)[-2]
    assert reads[newest.name] == 3, reads


def test_a_part_changed_after_the_launchers_check_is_read_again(run, reads):
    verified = audit_log.check_audit_log(run, after_step=2, mark=False).verified
    assert verified and set(reads.values()) == {1}
    again = audit_log.check_audit_log(run, after_step=2, mark=False, known=verified)
    assert again.parts_verified == 0  # unchanged: nothing read
    part = audit_log.part_files(run)[-1]
    stat = part.stat()
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # rewritten in between
    assert audit_log.check_audit_log(run, after_step=2, mark=False, known=verified).parts_verified == 1
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged in between, same size
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=part.name):
        audit_log.check_audit_log(run, after_step=2, mark=False, known=verified)


def test_the_writer_skips_the_parts_marked_unchanged(run, reads, tmp_path):
    copy = Path(shutil.copytree(run, tmp_path / "copy"))  # control: the same log, no marks
    verified = audit_log.check_audit_log(run, after_step=2, mark=False).verified
    part = audit_log.part_files(run)[-1]
    rank = int(part.name[len("part-r") : len("part-r") + 5])
    assert audit_log.mark_known(run, rank, verified) == 1
    reads.clear()
    audit_log.AuditLogWriter(run, rank=rank, verify=True)
    assert reads[part.name] == 0, reads
    audit_log.AuditLogWriter(copy, rank=rank, verify=True)
    assert reads[part.name] == 1, reads
