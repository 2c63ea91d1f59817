"""Progress bars for long commands (`bench`, `bisect`): tqdm on stderr, on a terminal only.

    with progress_bar("bench ops", unit="case") as bar:
        ...
        bar.done("matmul-512")          # one more finished; its name shown beside the count

Guarantees:
- A bar writes to stderr only, so stdout stays free for --json (one JSON object) and tables.
- Shown only when stderr is a terminal; in a pipe, a log file or CI nothing is written at all (no
  tqdm object is made either: even a disabled one creates tqdm's process-shared lock, which rank
  processes that leave by os._exit would leak). `TITAN_AUDIT_PROGRESS=0` turns bars off on a
  terminal too, `=1` forces them on (the same rule everywhere, --json or not).
- The bar is cleared when its block ends (`leave=False`): what a command prints after it stays
  as short as without it.
No titan_audit imports: it sits below every layer, like log.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

PROGRESS_ENV = "TITAN_AUDIT_PROGRESS"


def progress_enabled() -> bool:
    """TITAN_AUDIT_PROGRESS (0/1) if set, else whether stderr is a terminal."""
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        return forced in ("1", "true", "yes", "on")
    return sys.stderr.isatty()


class Bar:
    """One bar (a counter when `total` is None); with no tqdm behind it, every call does nothing."""

    def __init__(self, bar) -> None:
        self._bar = bar

    def done(self, name: str = "", n: int = 1) -> None:
        """`n` more items finished, the last named `name`."""
        if self._bar is not None:
            if name:
                self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(n)

    def describe(self, text: str) -> None:
        """What is running now (the bar's description)."""
        if self._bar is not None:
            self._bar.set_description_str(text)


@contextlib.contextmanager
def progress_bar(desc: str, *, total: int | None = None, unit: str = "it") -> Iterator[Bar]:
    """A Bar on stderr for the with block when `progress_enabled()`, else one that does nothing."""
    if not progress_enabled():
        yield Bar(None)
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
    try:
        yield Bar(bar)
    finally:
        bar.close()
