"""What a killed `data prepare` leaves (`.NAME.XXXX.tmp` next to its output) is removed by the next
prepare of that output, never what a live writer (one holding the output's lock) is building."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit.atomic import lock_path
from titan_audit.data import PrepareConfig, prepare


def _source(directory: Path) -> Path:
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    return path


def _killed_writer(out: Path) -> Path:
    """A process that starts writing the token store `out` and dies by SIGKILL halfway; the
    temporary directory it left."""
    code = (
        "import os, signal, sys\n"
        "from titan_audit.atomic import atomic_output_dir\n"
        "from titan_audit.data.token_store import store_output_lock\n"
        "with store_output_lock(sys.argv[1]), atomic_output_dir(sys.argv[1]) as tmp:\n"
        "    (tmp / 'half').write_text('x')\n"
        "    print(tmp, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    left = Path(done.stdout.strip())
    assert left.is_dir() and left.name.startswith(f".{out.name}.") and left.name.endswith(".tmp")
    return left


def test_the_next_prepare_removes_what_a_killed_prepare_left_and_says_so(tmp_path: Path, caplog) -> None:
    source = _source(tmp_path)
    out = tmp_path / "data" / "corpus.zarr"
    left = _killed_writer(out)
    old = out.with_name(f".{out.name}.abcd_123.old")  # a killed overwrite's set-aside store
    old.mkdir()
    other = out.with_name(".other.zarr.abcd_123.tmp")  # another output's: not ours to judge
    other.mkdir()
    assert not out.exists()

    with caplog.at_level(logging.INFO, logger="titan_audit"):
        info = prepare(PrepareConfig(sources=(str(source),), out=str(out)))

    assert info.num_docs == 20 and out.is_dir()
    assert not left.exists() and not old.exists()
    assert other.is_dir()
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed ")]
    assert len(removed) == 2 and any(str(left) in m for m in removed) and any(str(old) in m for m in removed)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, other.name])  # the lock file too is gone


def test_a_live_writers_temporary_is_kept_and_the_second_writer_refused(tmp_path: Path) -> None:
    source = _source(tmp_path)
    out = tmp_path / "corpus.zarr"
    code = (
        "import sys\n"
        "from titan_audit.atomic import atomic_output_dir\n"
        "from titan_audit.data.token_store import store_output_lock\n"
        "with store_output_lock(sys.argv[1]), atomic_output_dir(sys.argv[1]) as tmp:\n"
        "    print(tmp, flush=True)\n"
        "    sys.stdin.read()\n"  # until the test closes our stdin
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdin is not None
        live = Path(writer.stdout.readline().strip())
        assert live.is_dir() and lock_path(out).is_file()
        with pytest.raises(ValueError, match=rf"corpus\.zarr is being written by another process \(pid {writer.pid}\)"):
            prepare(PrepareConfig(sources=(str(source),), out=str(out)))
        assert live.is_dir()  # a live writer's temporary is never removed
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert out.is_dir() and not live.exists() and not lock_path(out).exists()  # the writer finished
    with pytest.raises(ValueError, match="already exists"):
        prepare(PrepareConfig(sources=(str(source),), out=str(out)))


def test_a_refused_prepare_still_removes_the_leftovers_and_creates_nothing(tmp_path: Path) -> None:
    source = _source(tmp_path)
    out = tmp_path / "corpus.zarr"
    prepare(PrepareConfig(sources=(str(source),), out=str(out)))
    left = _killed_writer(out.with_name("again.zarr"))  # a killed --overwrite of a store that exists
    (tmp_path / "again.zarr").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        prepare(PrepareConfig(sources=(str(source),), out=str(tmp_path / "again.zarr")))
    assert not left.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    with pytest.raises(ValueError, match="no key 'text'"):
        prepare(PrepareConfig(sources=(str(bad),), out=str(tmp_path / "new" / "dir" / "bad.zarr")))
    assert not (tmp_path / "new").exists()
