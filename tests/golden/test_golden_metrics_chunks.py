"""Goldens and runs whose metrics.parquet is a directory of chunks (audit/run_metrics.py).

Proves: a golden recorded from a chunked run is a golden `check` accepts (exact mode), against
the chunked run and against the same run in the single-file layout (a run written before the
chunks); the golden keeps a single metrics.parquet file. Control: one ULP changed in one metric of
the chunked run (through the writer, as a resume rewrites a chunk) fails the check, named.
"""

from __future__ import annotations

import math
import shutil

from click.testing import CliRunner

from titan_audit.audit import run_metrics
from titan_audit.audit.run_metrics import METRICS, MetricsLog, chunk_files, read_metrics
from titan_audit.cli.main import cli
from titan_audit.golden import check_golden, read_golden


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_golden_of_a_chunked_run(base_run, tmp_path, monkeypatch):
    monkeypatch.setattr(run_metrics, "CHUNK", 2)
    single = shutil.copytree(base_run, tmp_path / "single")
    assert (single / METRICS).is_file()
    chunked = shutil.copytree(base_run, tmp_path / "chunked")
    log = MetricsLog(chunked)  # moves the single file into chunks
    assert (chunked / METRICS).is_dir() and len(chunk_files(chunked)) == 2
    result = _cli("golden", "record", chunked, tmp_path / "golden")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "golden" / METRICS).is_file()
    assert read_golden(tmp_path / "golden").metrics.num_rows == len(log.rows) == 3
    for run in (chunked, single):
        check = check_golden(run, tmp_path / "golden")
        assert check.passed and check.mode == "exact", check.failures
    # control: one ULP in the loss of step 3 (the last chunk, rewritten by the writer)
    log.truncate_after(2)
    row = read_metrics(single).to_pylist()[2]
    row["loss"] = math.nextafter(row["loss"], math.inf)
    log.append(row)
    log.flush()
    result = _cli("golden", "check", chunked, tmp_path / "golden")
    assert result.exit_code == 1
    assert "metric value(s) differ bitwise; first: loss at step 3" in result.output
