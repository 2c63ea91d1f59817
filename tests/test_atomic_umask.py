"""Files and directories written through titan_audit/atomic.py get the modes the umask gives a
plain open() / mkdir(), not mkstemp's private 0600 / mkdtemp's 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from titan_audit import atomic


@pytest.fixture(params=[0o022, 0o027, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_current_umask_reads_without_changing_it(umask: int) -> None:
    assert atomic.current_umask() == umask
    assert atomic.current_umask() == umask


def test_atomic_outputs_respect_the_umask(tmp_path: Path, umask: int) -> None:
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask

    atomic.write_bytes_atomic(tmp_path / "a.bin", b"x")
    atomic.write_json_atomic(tmp_path / "manifest.json", {"a": 1})
    atomic.write_json_atomic(tmp_path / "manifest.json", {"a": 2})  # replacing it: the same mode
    with atomic.atomic_output_file(tmp_path / "f.parquet") as tmp:
        tmp.write_bytes(b"y")
    with atomic.atomic_output_dir(tmp_path / "store.zarr") as tmp:
        (tmp / "inner").write_bytes(b"z")
    with atomic.atomic_output_dir(tmp_path / "store.zarr", overwrite=True) as tmp:
        (tmp / "inner").write_bytes(b"w")
    with atomic.output_lock(tmp_path / "store.zarr"):
        assert _mode(tmp_path / ".store.zarr.lock") == file_mode

    for name in ("a.bin", "manifest.json", "f.parquet", "store.zarr/inner"):
        assert _mode(tmp_path / name) == file_mode, (name, oct(_mode(tmp_path / name)))
    assert _mode(tmp_path / "store.zarr") == dir_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.bin",
        "f.parquet",
        "manifest.json",
        "store.zarr",
    ]


def test_without_proc_the_umask_is_read_by_setting_and_restoring_it(monkeypatch, umask: int) -> None:
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_proc)
    assert atomic.current_umask() == umask
    monkeypatch.undo()
    assert atomic.current_umask() == umask  # restored
