"""report/: the run report, one self-contained HTML file and its Markdown twin.

    paths = write_report("runs/a")                      # RUN/reports/report.html and report.md
    paths = write_report("runs/a", against="runs/b")    # plus the divergence map of a compare

For any run directory: a training run, an RL run (zero-gap table and plot) or a `titan-audit demo`
directory (the verdict table and every sub-run). Contents: loss / reward curves
(metrics.parquet), audit coverage (what was hashed, records per phase and step, from
RUN/audit/*.parquet), starts and resumes, elastic replays and their bitwise verdicts, and with
`against` the comparison and its divergence map (steps x phase/module).

Guarantees:
- Reads run directories only; writes nothing but RUN/reports/report.html and report.md, each
  atomically (titan_audit.atomic: a crash leaves the old report or the new one). A report is
  derived data, so a newer one replaces an older one.
- The HTML is self-contained: plots as base64 PNG (matplotlib, Agg canvas), styles inline, no
  script and no external resource.
- Bad input (a missing path, a directory that is no run, an unreadable manifest or audit part)
  is a ValueError naming the path, before anything is written.

Dependencies point down: this package reads audit/, trainer/ and rl/; nothing below imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_audit.atomic import write_bytes_atomic
from titan_audit.report.divergence import DivergenceMap, divergence_map
from titan_audit.report.render import build
from titan_audit.report.runs import coverage, run_kind

REPORT_HTML = "report.html"
REPORT_MD = "report.md"

__all__ = ["DivergenceMap", "build", "coverage", "divergence_map", "run_kind", "write_report"]


def write_report(run: str | os.PathLike, against: str | os.PathLike | None = None) -> dict[str, str]:
    """Write RUN/reports/report.{html,md}; returns {"kind", "html", "md"} (paths as strings)."""
    run = Path(run)
    kind, page, md = build(run, against)
    reports = run / "reports"
    html_path, md_path = reports / REPORT_HTML, reports / REPORT_MD
    write_bytes_atomic(html_path, page.encode(), overwrite=True)
    write_bytes_atomic(md_path, md.encode(), overwrite=True)
    for path in (html_path, md_path):
        os.chmod(path, 0o644)  # mkstemp made them private; a report is for reading
    return {"kind": kind, "html": str(html_path), "md": str(md_path)}
