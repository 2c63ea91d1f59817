"""A damaged audit part (RUN/audit/part-*.parquet) is named in one line, never appended to, never a traceback.

Proves: `train --resume` of a run whose audit log has a truncated part, or a part with a flipped
byte in a data page (caught by the Parquet page checksums the writer adds), stops with exit 2 and
one line naming the part, before anything is appended (the run's files are unchanged); the
Recorder refuses the same way in the library when the part it appends to is damaged; an older
damaged part is found by `verify_audit_log` / `titan-audit verify`. A resume reads the part it
appends to once (the launcher's check), not once per check. `compare`, `golden check` and `report` (also
`report --against`) on such a run exit 2 with one line naming the part. Negative control: the
resume of an undamaged copy goes on to the last step and appends its records.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from fault_injection import one_line_error as _one_line_error

from titan_audit.audit import Recorder
from titan_audit.audit.log import part_files, read_audit_log, verify_audit_log
from titan_audit.cli.main import cli
from titan_audit.trainer.config import load_config
from titan_audit.trainer.train import train

SMALL = [
    "steps=4",
    "checkpoint.interval=2",
    "audit.flush_every_steps=1",
    "data.global_batch_size=1",
    "data.seq_len=32",
    "data.synthetic_records=256",
    "parallel.threads=1",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A run stopped after step 2 of 4 (resumable), and a golden of it."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("damaged")
    train(load_config("tiny-dense", SMALL), root / "run", quiet=True, stop_at=2)
    torch.set_num_threads(threads)
    assert len(part_files(root / "run")) >= 2
    result = CliRunner().invoke(cli, ["golden", "record", str(root / "run"), str(root / "golden")])
    assert result.exit_code == 0, result.output
    return root


def _copy(base: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(base / "run", tmp_path / name))


def _truncate(part: Path) -> None:
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])


def _flip_data_byte(part: Path) -> None:
    """Flip one byte in the middle of the first column chunk's data page (not footer, not header)."""
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    offset = start + chunk.total_compressed_size - 4  # inside the last page's compressed values
    data = bytearray(part.read_bytes())
    data[offset] ^= 0x01
    part.write_bytes(bytes(data))


def _snapshot(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("damage", [_truncate, _flip_data_byte], ids=["truncated", "flipped-byte"])
def test_resume_refuses_a_damaged_part_before_appending(base, tmp_path, damage):
    run = _copy(base, tmp_path)
    part = part_files(run)[1]
    damage(part)
    before = _snapshot(run)
    result = _invoke("train", "--out", run, "--resume")
    _one_line_error(result, f"{part}: unreadable (", "the audit log of this run is damaged")
    assert _snapshot(run) == before  # nothing appended, no manifest entry for the failed start


def test_recorder_refuses_a_damaged_last_part(base, tmp_path):
    run = _copy(base, tmp_path)
    part = part_files(run)[-1]  # the part a resume appends to
    _truncate(part)
    parts = part_files(run)
    with pytest.raises(ValueError, match=f"^{part}: unreadable .*damaged"):
        Recorder(run, level="params")
    assert part_files(run) == parts
    with pytest.raises(ValueError, match=f"^{part}: unreadable"):
        verify_audit_log(run)


def test_an_older_damaged_part_is_found_by_verify(base, tmp_path):
    """The Recorder reads only the parts it appends to (its cost does not grow with the log); an
    older part stands on its digest in the index, and `verify` reads it."""
    run = _copy(base, tmp_path)
    part = part_files(run)[0]
    _truncate(part)
    Recorder(run, level="params").close()
    with pytest.raises(ValueError, match=f"^{part}: unreadable"):
        verify_audit_log(run)
    result = _invoke("verify", run)
    assert result.exit_code == 1 and f"{part}: unreadable (" in result.output, result.output


def test_negative_control_resume_of_an_intact_copy_appends(base, tmp_path):
    run = _copy(base, tmp_path)
    before = len(part_files(run))
    assert verify_audit_log(run) == read_audit_log(run).num_rows > 0
    result = _invoke("train", "--out", run, "--resume")
    assert result.exit_code == 0, result.output
    assert len(part_files(run)) > before
    assert sorted(set(read_audit_log(run, columns=["step"])["step"].to_pylist())) == [1, 2, 3, 4]


def test_a_resume_reads_only_the_tail_it_appends_to(base, tmp_path, monkeypatch):
    """A resume reads back only the part it appends to (the run stopped at its checkpoint, step 2),
    once: the launcher's check reads it and hands it to rank 0's check and the Recorder, which
    skip it unchanged; part 0 stands on its digest, whatever the run's length. Control: without an
    index (a run written before it), every part is read."""
    import shutil

    from titan_audit.audit import log

    run = _copy(base, tmp_path)
    reads: list[str] = []
    real = log.verify_part
    monkeypatch.setattr(log, "verify_part", lambda part, entry=None: (reads.append(part.name), real(part, entry))[1])
    result = _invoke("train", "--out", run, "--resume")
    assert result.exit_code == 0, result.output
    tail = part_files(run)[1].name
    assert reads == [tail]  # the launcher's check; rank 0 and the Recorder were handed it
    assert verify_audit_log(run) == read_audit_log(run).num_rows
    reads.clear()
    control = _copy(base, tmp_path, "control")
    shutil.rmtree(control / "audit" / "_index")
    result = _invoke("train", "--out", control, "--resume")
    assert result.exit_code == 0, result.output
    assert part_files(control)[0].name in reads


def test_compare_golden_check_and_report_name_the_damaged_part(base, tmp_path):
    run = _copy(base, tmp_path)
    part = part_files(run)[1]
    _flip_data_byte(part)
    needle = f"{part}: unreadable ("
    _one_line_error(_invoke("compare", base / "run", run), needle)
    _one_line_error(_invoke("compare", run, base / "run", "--json"), needle)
    _one_line_error(_invoke("golden", "check", run, base / "golden"), needle)
    _one_line_error(_invoke("report", run), needle)
    _one_line_error(_invoke("report", base / "run", "--against", run), needle)
    # negative control: the intact run still compares and checks
    assert _invoke("compare", base / "run", base / "run").exit_code == 0
    assert _invoke("golden", "check", base / "run", base / "golden").exit_code == 0
