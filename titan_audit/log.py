"""One way to say things: the `titan_audit` loggers.

Library modules take a logger and never configure logging themselves::

    from titan_audit.log import get_logger

    log = get_logger(__name__)
    log.info("resumed from step %d", step)   # progress, status
    log.warning("...")                       # something the user should look at
    log.debug("...")                         # detail, shown with -v

A library that is imported but never configured prints nothing (the standard practice: a
`NullHandler` on the package logger; an application that wants the lines configures logging, or
calls `configure`). The CLI calls `configure(verbose)` once; ranks started by torchrun call it
too, and read the verbosity the CLI exported in `TITAN_AUDIT_VERBOSE`.

Every line carries the rank it came from (`[rank 0] resumed from step 4`). By default only rank 0
logs at INFO, the other ranks log warnings and errors; with `verbose` every rank logs, at DEBUG.
The rank is read when a line is written: `torch.distributed` if it is initialised, else the `RANK`
environment variable (torchrun sets it), else 0. torch is never imported here.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["PACKAGE", "VERBOSE_ENV", "configure", "get_logger", "get_rank", "verbose_from_env"]

PACKAGE = "titan_audit"
VERBOSE_ENV = "TITAN_AUDIT_VERBOSE"
_TRUE = {"1", "true", "yes", "on", "debug"}

logging.getLogger(PACKAGE).addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger for `name` (usually `__name__`), always under the `titan_audit` namespace."""
    if name == PACKAGE or name.startswith(PACKAGE + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{PACKAGE}.{name}" if name else PACKAGE)


def get_rank() -> int:
    """This process's rank: torch.distributed when initialised, else $RANK, else 0."""
    torch = sys.modules.get("torch")  # only if someone imported it already; never import it here
    if torch is not None:
        try:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # a half-initialised or torn-down process group: fall back to the env
            pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def verbose_from_env() -> bool:
    """Whether `TITAN_AUDIT_VERBOSE` asks for verbose logging (1, true, yes, on)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in _TRUE


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (so redirections and test capture work)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # the base class sets it in __init__; always follow sys.stderr
        pass


class _RankFilter(logging.Filter):
    """Stamps the rank on each record; drops INFO/DEBUG from ranks other than 0 unless verbose."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank = rank
        if self.verbose:
            return True
        return record.levelno >= (logging.INFO if rank == 0 else logging.WARNING)


class _Formatter(logging.Formatter):
    """`[rank R] message`; levels other than INFO are named (`[rank 1] warning: ...`)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rank = getattr(record, "rank", None)
        if rank is None:
            rank = get_rank()
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return "\n".join(f"[rank {rank}] {level}{line}" for line in text.splitlines() or [""])


def configure(verbose: bool = False) -> logging.Logger:
    """Send the `titan_audit` logs to stderr; call once per process (the CLI and each rank do).

    `verbose` (or `TITAN_AUDIT_VERBOSE=1` in the environment, which the CLI's `-v` exports for
    the ranks it starts): every rank logs, at DEBUG. Otherwise rank 0 logs at INFO and the others
    log warnings and errors only. Calling it again replaces the handler it installed before, so
    handlers never pile up. Returns the package logger.
    """
    verbose = bool(verbose) or verbose_from_env()
    logger = logging.getLogger(PACKAGE)
    for handler in list(logger.handlers):
        if getattr(handler, "_titan_audit", False):
            logger.removeHandler(handler)
            handler.close()
    handler = _StderrHandler()
    handler._titan_audit = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(verbose))
    handler.setFormatter(_Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    return logger
