"""Faults of the machine, said in one line: OS errors (a read-only directory, a full disk) and
library errors become a line naming the path at fault; the traceback goes to a log file.

Guarantees:
- `error_line(error)` is one line: for an OSError the path (both paths of a rename), what went
  wrong in words and the errno name (`RUN/manifest.json: permission denied (EACCES)`), never
  Python's `[Errno 13] ...` repr; for anything else its own message, cut to its first line.
- `save_traceback(error)` writes the full traceback to `RUN/logs/error-<UTC time>-<pid>.log`, RUN
  being the nearest run directory (a directory holding `manifest.json`) above the path at fault,
  or to the system temp directory when there is none or the run directory cannot be written (the
  usual case of a read-only run); it returns the file written, or None when nothing could be.
- `user_errors()` is the one list of what reaches the user as that line rather than a traceback
  (the CLI and a launch's ranks both use it): bad input (ValueError), a missing or stale build
  of the CPU kernels (KernelLibraryError, which says what to run) and the machine's faults
  (OSError); `user_message(error)` is the line.
- `describe(error)`: the line the user sees, with where the traceback went. A path the user
  named wrongly (ENOENT, ENOTDIR, EISDIR, or our own message without an errno) is one line and no
  file: there is nothing more to read. An error translated from a library's (one raised `from`
  its cause) keeps its traceback, the cause's included.

No titan_audit imports: it sits below every layer, like atomic.py.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path

__all__ = ["error_line", "describe", "save_traceback", "user_errors", "user_message", "LOG_DIR"]

LOG_DIR = "logs"  # under a run directory
# where KernelLibraryError lives; looked up, never imported: that would import torch for every
# command, --help included (an error of that type exists only once its module is loaded)
_KERNEL_LIBRARY_MODULE = "titan_audit.batch_invariant.cpu._lib"
_MANIFEST = "manifest.json"
_USER_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}
_WORDS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EIO: "input/output error",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
    errno.EMFILE: "too many open files",
}


def error_line(error: BaseException) -> str:
    """One line that says what went wrong and where (see the module docstring)."""
    if isinstance(error, OSError) and error.errno is not None:
        words = _WORDS.get(error.errno) or (error.strerror or "").lower() or "OS error"
        code = errno.errorcode.get(error.errno, str(error.errno))
        where = " -> ".join(os.fspath(p) for p in (error.filename, error.filename2) if p is not None)
        return f"{where}: {words} ({code})" if where else f"{words} ({code})"
    text = str(error).strip()
    first = text.splitlines()[0].strip() if text else ""
    return first or type(error).__name__


def _run_dir_above(path: str | os.PathLike | None) -> Path | None:
    if path is None:
        return None
    here = Path(os.path.abspath(path))
    for candidate in (here, *here.parents):
        if (candidate / _MANIFEST).is_file():
            return candidate
    return None


def save_traceback(error: BaseException, path: str | os.PathLike | None = None) -> Path | None:
    """Write `error`'s traceback next to the run it concerns (see the module docstring). `path`:
    where the fault happened, when the error does not say (an OSError's filename does)."""
    if path is None and isinstance(error, OSError):
        path = error.filename
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    text = "".join(traceback.format_exception(error))
    run = _run_dir_above(path)
    places = [(run / LOG_DIR, f"error-{stamp}-{os.getpid()}.log")] if run is not None else []
    places.append((Path(tempfile.gettempdir()), f"titan-audit-error-{stamp}-{os.getpid()}.log"))
    for directory, name in places:
        try:
            directory.mkdir(exist_ok=True)
            target = directory / name
            with open(target, "a", encoding="utf-8") as f:
                f.write(text)
            return target
        except OSError:
            continue
    return None


def describe(error: BaseException, path: str | os.PathLike | None = None) -> str:
    """`error_line`, and for a fault of the machine or a library where its traceback was saved."""
    line = error_line(error)
    if error.__cause__ is None and isinstance(error, OSError):
        if error.errno is None or error.errno in _USER_PATH_ERRNOS:
            return line
    saved = save_traceback(error, path)
    return f"{line} (traceback in {saved}; -v prints it)" if saved is not None else line


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user sees as one line (see the module docstring)."""
    module = sys.modules.get(_KERNEL_LIBRARY_MODULE)
    kernel = getattr(module, "KernelLibraryError", None)
    return (ValueError, OSError, *((kernel,) if kernel is not None else ()))


def user_message(error: BaseException, path: str | os.PathLike | None = None) -> str:
    """The one line of a user error: an OSError by `describe` (`path`: where it happened when the
    error does not say), anything else its own message."""
    return describe(error, path) if isinstance(error, OSError) else str(error)
