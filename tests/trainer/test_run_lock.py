"""One writer per run directory (run_dir.claim_run_dir): a live holder is named and refused, a
stale lock file (its holder dead) never blocks, a foreign directory never gets a lock file."""

import subprocess
import sys

import pytest

from titan_audit.audit.run_lock import LOCK, lock_existing_run, release
from titan_audit.trainer.run_dir import claim_run_dir, claimed_run_dir

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


def _run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    return out


def test_a_live_holder_is_refused_by_pid_and_released_by_its_death(tmp_path):
    out = _run(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out / LOCK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"process {holder.pid} \(.*\) is writing this run"):
            claim_run_dir(out, resume=True, overwrite=False)
        with pytest.raises(ValueError, match=f"process {holder.pid}"):
            lock_existing_run(out)
    finally:
        holder.kill()
        holder.wait()
    # the lock file still names the dead holder: stale, it does not block
    assert (out / LOCK).read_text().strip() == str(holder.pid)
    with claimed_run_dir(out, resume=True, overwrite=False) as claimed:
        assert claimed == out
        assert (out / LOCK).read_text().strip() != str(holder.pid)
        lock_existing_run(out)  # nests in the same process
        release(out)


def test_a_fresh_run_is_locked_and_a_foreign_directory_is_left_alone(tmp_path):
    fresh = tmp_path / "fresh"
    with claimed_run_dir(fresh, resume=False, overwrite=False):
        assert sorted(p.name for p in fresh.iterdir()) == [LOCK]
        with claimed_run_dir(fresh, resume=False, overwrite=False):  # only the lock file: still empty
            pass
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        claim_run_dir(foreign, resume=False, overwrite=False)
    assert not lock_existing_run(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["keep.txt"]
