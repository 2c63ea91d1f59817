#!/usr/bin/env python
"""Make the performance tables of README.md and docs/performance.md from benchmarks/results/.

    .venv/bin/python scripts/perf_tables.py           # rewrite the generated parts of both pages
    .venv/bin/python scripts/perf_tables.py --check   # exit 1 when a page is not what the files give

The tables are a pure function of the saved results (`titan-audit bench SUITE --save`): the newest
file of each suite per machine kind (titan_audit/bench/results.py). Only the text between a page's
`<!-- perf:NAME:begin -->` and `<!-- perf:NAME:end -->` markers changes. A results file that is
not a saved result, or a page without its markers, is one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from titan_audit.atomic import write_bytes_atomic
from titan_audit.bench.results import generated_pages

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if a page is stale; write nothing.")
    parser.add_argument("--results-dir", type=Path, default=None, help="Default: benchmarks/results/.")
    args = parser.parse_args(argv)
    try:
        pages = generated_pages(ROOT, args.results_dir)
    except (ValueError, OSError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, text in pages.items() if path.read_text() != text]
    for path in stale:
        if args.check:
            print(f"{path.relative_to(ROOT)}: the performance tables differ from benchmarks/results/ (run {__file__})")
        else:
            write_bytes_atomic(path, pages[path].encode(), overwrite=True)
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
