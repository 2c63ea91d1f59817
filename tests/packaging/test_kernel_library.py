"""One build recipe for the kernels (kernel_build.py) and the loader's freshness check.

- The library loaded here carries the hash of the sources and flags it was built from, and that is
  the hash of the sources here (make kernels, an editable install and a wheel all build it so).
- The hash changes with one byte of one source or header and with one flag (negative controls).
- Where the sources are present, a library built from other sources (or by a build that records
  none) is refused, naming what to run; where they are not (an installed wheel), it is not.
- The flags exist once: the Makefile and setup.py run kernel_build.py and repeat none of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit.batch_invariant.cpu import _lib, kernel_build

ROOT = Path(__file__).resolve().parents[2]


def test_the_loaded_library_was_built_from_the_sources_here():
    import ctypes

    built_from = getattr(_lib.library(), kernel_build.HASH_SYMBOL)
    built_from.restype = ctypes.c_char_p
    assert built_from().decode() == kernel_build.source_hash()
    assert _lib.SOURCE_DIR == kernel_build.KERNEL_DIR and _lib.LIB_PATH == kernel_build.LIB_PATH


def test_the_source_hash_changes_with_one_source_byte_and_with_one_flag(tmp_path, monkeypatch):
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_build.KERNEL_DIR, copy)
    same = kernel_build.source_hash(copy)
    assert same == kernel_build.source_hash()
    header = copy / "ta_common.h"
    header.write_bytes(header.read_bytes() + b" ")
    assert kernel_build.source_hash(copy) != same
    monkeypatch.setattr(kernel_build, "CXXFLAGS", (*kernel_build.CXXFLAGS, "-ffast-math"))
    assert kernel_build.source_hash() != same
    assert kernel_build.source_hash(copy.with_name("absent")) != same  # no sources: not the same hash either


def test_the_recipe_builds_every_variant_of_x86_64_and_scalar_elsewhere():
    assert kernel_build.isas("x86_64") == ("scalar", "avx2", "avx512") and kernel_build.isas("aarch64") == ("scalar",)
    flags = kernel_build.recipe("x86_64")
    assert "-ffp-contract=off" in flags["cxxflags"] and "-fno-fast-math" in flags["cxxflags"]
    assert not [f for f in flags["cxxflags"] if "fast-math" in f and f != "-fno-fast-math"]
    assert flags["isas"]["scalar"] == ["-DTA_ISA_SCALAR", "-mno-fma", "-mno-avx"]
    assert kernel_build.recipe("aarch64")["isas"] == {"scalar": ["-DTA_ISA_SCALAR"]}
    with pytest.raises(ValueError, match="no 'avx2' variant on aarch64"):
        kernel_build.isa_flags("avx2", "aarch64")


def _stale_sources(tmp_path: Path, touch_newer: bool) -> Path:
    copy = tmp_path / "kernels"
    shutil.copytree(kernel_build.KERNEL_DIR, copy)
    edited = copy / "gemm.cpp"
    edited.write_text(edited.read_text() + "\n// edited\n")
    when = _lib.LIB_PATH.stat().st_mtime + (60 if touch_newer else -60)
    for p in copy.iterdir():
        os.utime(p, (when, when) if p == edited else (when - 120, when - 120))
    return copy


@pytest.mark.parametrize("newer", [True, False], ids=["edited-after-the-build", "other-sources-older-mtime"])
def test_a_library_built_from_other_sources_is_refused_saying_what_to_run(tmp_path, monkeypatch, newer):
    lib = _lib.library()
    _lib._check_built_from_sources(lib)  # the real sources: accepted (the control)
    monkeypatch.setattr(_lib, "SOURCE_DIR", _stale_sources(tmp_path, newer))
    expected = r"older than its sources \(gemm\.cpp\)" if newer else "built from other kernel sources or flags"
    with pytest.raises(_lib.KernelLibraryError, match=expected) as error:
        _lib._check_built_from_sources(lib)
    assert "make kernels" in str(error.value)


def test_a_library_that_records_no_sources_is_refused_where_sources_are(monkeypatch):
    class OldBuild:  # what the pre-hash Makefile built: no ta_kernels_source_hash
        pass

    with pytest.raises(_lib.KernelLibraryError, match="does not say what it was built from"):
        _lib._check_built_from_sources(OldBuild())


def test_without_sources_an_installed_library_is_not_checked_against_them(tmp_path, monkeypatch):
    monkeypatch.setattr(_lib, "SOURCE_DIR", tmp_path / "not-shipped")
    _lib._check_built_from_sources(object())  # nothing to compare with: the version check only
    assert "reinstall titan-audit" in _lib._build_hint()


def test_the_flags_live_only_in_kernel_build():
    makefile = "\n".join(line for line in (ROOT / "Makefile").read_text().splitlines() if not line.startswith("#"))
    for text in (makefile, (ROOT / "setup.py").read_text()):
        assert "kernel_build" in text
        assert not [f for f in ("-ffp-contract", "-mavx", "-fno-fast-math", "-DTA_ISA") if f in text]


def test_the_build_script_runs_without_torch_and_prints_the_hash_a_library_carries():
    """`python3 -I kernel_build.py hash` (as `make` runs it): stdlib only, same hash as here."""
    script = kernel_build.HERE / "kernel_build.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(script), "hash"], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == kernel_build.source_hash()
