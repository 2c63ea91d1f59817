"""The Python code of titan_audit/ explains itself: no issue number and no dated figure in it.

Issue numbers point at a tracker that is not in the repository, and a dated measurement goes stale
while the code moves on; the history is in git, the measurements in the benchmark results (the
goldens' JSON keep their dates: only `*.py` is read). Flagged:
- a reference to an issue anywhere in a module (`issue 24`, `issues 24 and 26`, `Issue 48's`);
- `#24` in a comment (a `#` that starts a number after a space or a bracket; `name#1` and colours
  in strings such as `#222` are not comments);
- a date: ISO (`2026-12-06`), with a month name (`Dec 6, 2026`, `6 December 2026`, `December
  2026`), or a measurement said to be made on or in a date (`measured on 2026-...`).
Files read as text and tokens (nothing imported); a negative control runs the scan on made-up text.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "titan_audit"

# Modules whose owners are cleaning them: flagged lines there are reported by
# `test_modules_not_yet_clean_are_listed`, not failed. Empty this set to make the check strict.
NOT_YET_CLEAN: set[str] = set()

MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
ANYWHERE = {
    "issue reference": re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE),
    "ISO date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "date with a month name": re.compile(
        rf"\b{MONTH}\.?\s+(?:[0-3]?\d(?:st|nd|rd|th)?,?\s+)?20\d\d\b|\b[0-3]?\d(?:st|nd|rd|th)?\s+{MONTH}\.?,?\s+20\d\d\b"
    ),
    "dated measurement": re.compile(r"\bmeasured\s+(?:on|in)\s+(?:20\d\d|" + MONTH + r"\b)", re.IGNORECASE),
}
IN_COMMENTS = {"issue number": re.compile(r"(?:^|[\s(\[])#\d+\b")}


def flagged(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the line's text) of every issue reference and dated figure in Python source `text`."""
    lines = text.splitlines()
    found = set()
    for number, line in enumerate(lines, 1):
        for what, pattern in ANYWHERE.items():
            if pattern.search(line):
                found.add((number, what))
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            for what, pattern in IN_COMMENTS.items():
                if pattern.search(token.string):
                    found.add((token.start[0], what))
    return [(number, what, lines[number - 1].strip()) for number, what in sorted(found)]


def scan() -> dict[str, list[tuple[int, str, str]]]:
    """{path under titan_audit/: flagged lines} for every `*.py` with at least one."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        hits = flagged(path.read_text())
        if hits:
            out[path.relative_to(ROOT).as_posix()] = hits
    return out


def test_no_issue_number_or_dated_figure_in_the_code():
    bad = {path: hits for path, hits in scan().items() if path not in NOT_YET_CLEAN}
    report = [f"titan_audit/{path}:{line}: {what}: {text}" for path, hits in bad.items() for line, what, text in hits]
    assert not report, "history belongs in git, measurements in the benchmark results:\n" + "\n".join(report)


def test_modules_not_yet_clean_are_listed():
    """Every module in NOT_YET_CLEAN exists and is still flagged: one that is clean leaves the set."""
    hits = scan()
    for path in sorted(NOT_YET_CLEAN):
        assert (ROOT / path).is_file(), f"titan_audit/{path}: in NOT_YET_CLEAN but not a file"
        assert path in hits, f"titan_audit/{path} is clean now: remove it from NOT_YET_CLEAN"


@pytest.mark.control
def test_the_scan_flags_made_up_history_and_leaves_plain_code_alone():
    """Negative control: made-up lines with each kind of history are flagged, on the lines they are on;
    code that merely looks similar (a colour, `name#1`, a 2048 vocabulary, a strftime pattern) is not."""
    text = "\n".join(
        [
            '"""Fast path (issue 26): 1.5 ms measured on 2026-11-30."""',  # 1: issue, ISO date
            "X = 1  # see #51",  # 2: issue number in a comment
            "Y = 2  # Issue 48's relation; measured in December 2026",  # 3: issue, month date, measurement
            "Z = 3  # the next day (6 Dec 2026) it was 2x",  # 4: month-name date
            "W = 4  # Nov. 3rd, 2026",  # 5: month-name date
            'CSS = "h1{color:#222}"  # a colour in a string',  # 6: clean
            "NAME = 'name#1'  # a second backward records as name#1",  # 7: clean
            'STAMP = "demo-%Y%m%dT%H%M%SZ"  # vocab 2048, issues of the tracker',  # 8: clean
        ]
    )
    hits = flagged(text)
    by_line: dict[int, set[str]] = {}
    for line, what, _ in hits:
        by_line.setdefault(line, set()).add(what)
    assert by_line == {
        1: {"issue reference", "ISO date", "dated measurement"},
        2: {"issue number"},
        3: {"issue reference", "date with a month name", "dated measurement"},
        4: {"date with a month name"},
        5: {"date with a month name"},
    }, hits
