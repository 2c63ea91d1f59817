"""Which code path torch's MKL takes on this machine, as MKL itself reports it.

MKL picks its kernels by CPU vendor as well as ISA: on an AMD CPU its sgemm runs a generic AVX2
path however wide the vector units are, on an Intel Xeon the AVX-512 kernels. The native side of
every bench ratio runs on that choice, so the ratios differ by vendor. The bench
records the path next to its figures (`machine.mkl_code_path`).

The path is read from the banner MKL prints with `MKL_VERBOSE=1` ("... for Intel(R) 64
architecture <path>, Lnx ..."), in a fresh Python process (the banner is printed once per
process, to the C stdout), which inherits this environment: `MKL_ENABLE_INSTRUCTIONS` and an
`LD_PRELOAD` such as scripts/mkl_intel_path.c change what it reports, as they change what the
bench's own native ops run. Reading it never changes anything in this process. It is MKL's
report, not a trace of its kernels: MKL asks two functions about the vendor, one for the banner
and one for the kernel choice, and a shim that answers only one makes them disagree
(scripts/mkl_intel_path.c answers both).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from collections.abc import Mapping

_PROBE = "import torch; a = torch.ones(64, 64); torch.mm(a, a)"
_BANNER = re.compile(r"^MKL_VERBOSE .*? for Intel\(R\) 64 architecture (?P<path>.+?), (?:Lnx|Win|Mac)", re.MULTILINE)
PROBE_TIMEOUT_S = 120


def mkl_code_path(env: Mapping[str, str] | None = None) -> str | None:
    """MKL's code path in a process started with `env` (default: this process's environment),
    e.g. "Intel(R) Architecture processors" (its generic path) or "Intel(R) Advanced Vector
    Extensions 512 (Intel(R) AVX-512) ..."; None when torch has no MKL or MKL printed no banner.
    One probe per distinct environment (~2 s: the probe imports torch)."""
    return _probe(frozenset((os.environ if env is None else env).items()))


@functools.cache
def _probe(env: frozenset[tuple[str, str]]) -> str | None:
    import torch

    if not torch.backends.mkl.is_available():
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            env={**dict(env), "MKL_VERBOSE": "1"},
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:  # a figure's label, never worth failing the bench for
        return None
    found = _BANNER.search(done.stdout)
    return found.group("path") if found else None
