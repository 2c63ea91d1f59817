"""The package build: a wheel carries the kernel library (every ISA variant of this machine's
architecture, built from the sources here) and the committed goldens, is tagged for the platform,
and works where there is no checkout: BI mode on its kernels gives the checkout's bits.

The wheel is built once per module from this checkout (`pip wheel --no-deps --no-build-isolation`:
no network; it reuses build/kernels, so after `make kernels` it only links)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from titan_audit.batch_invariant.cpu import _lib, kernel_build
from titan_audit.goldens import GOLDENS_DIR

ROOT = Path(__file__).resolve().parents[2]
CPU = "titan_audit/batch_invariant/cpu"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(ROOT),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (found,) = out.glob("titan_audit-*.whl")
    return found


@pytest.fixture(scope="module")
def unpacked(wheel, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(where)
    return where


def test_the_wheel_is_tagged_for_this_platform_not_pure(wheel):
    _name, _version, python, abi, platform = wheel.stem.split("-")
    assert (python, abi) == ("py3", "none") and platform != "any" and kernel_build.host_arch() in platform
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: false" in meta


def test_the_wheel_carries_the_library_with_every_variant_built_from_these_sources(unpacked):
    import ctypes

    lib_path = unpacked / CPU / kernel_build.LIB_NAME
    variants = kernel_build.isas()
    assert variants == (("scalar", "avx2", "avx512") if kernel_build.host_arch() == "x86_64" else ("scalar",))
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], capture_output=True, text=True, check=True)
    kernels: dict[str, set[str]] = {}
    for line in nm.stdout.splitlines():
        symbol = line.split()[-1]
        if symbol.startswith("ta_") and "__" in symbol:
            name, isa = symbol.rsplit("__", 1)
            kernels.setdefault(name, set()).add(isa)
    assert len(kernels) > 30 and "ta_gemm_f32" in kernels and "ta_attention_fwd_f32" in kernels
    assert {name: isas for name, isas in kernels.items() if isas != set(variants)} == {}  # every kernel, every variant
    lib = ctypes.CDLL(str(lib_path))
    assert lib.ta_kernels_version__scalar() == _lib.KERNELS_VERSION and lib.ta_variant_lanes__scalar() == 1
    if "avx2" in variants and lib.ta_cpu_supports_avx2():
        assert lib.ta_variant_lanes__avx2() == 8  # avx512: present above, run only where the CPU has it
    built_from = getattr(lib, kernel_build.HASH_SYMBOL)
    built_from.restype = ctypes.c_char_p
    assert built_from().decode() == kernel_build.source_hash()


def test_the_wheel_carries_the_goldens_byte_for_byte_and_no_sources_or_tests(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        goldens = sorted(p.parent.name for p in GOLDENS_DIR.glob("*/golden.json"))
        assert {"tiny-dense", "tiny-dense-bi"} <= set(goldens)  # the demo's
        for name in goldens:
            listed = json.loads((GOLDENS_DIR / name / "golden.json").read_text())["files"]
            for rel in ["golden.json", *listed]:
                member = f"titan_audit/goldens/{name}/{rel}"
                assert member in names, member
                assert z.read(member) == (GOLDENS_DIR / name / rel).read_bytes(), member
                if rel in listed:  # and they are what golden.json says (never re-recorded)
                    assert hashlib.sha256(z.read(member)).hexdigest() == listed[rel]["sha256"]
    assert not [n for n in names if n.endswith((".cpp", ".h", ".o", ".cmd"))]
    assert not [n for n in names if n.startswith("tests/")]


def test_the_installed_wheel_runs_bi_mode_on_its_own_kernels_without_a_checkout(unpacked, tmp_path):
    """The unpacked wheel first on sys.path, run from a directory outside the checkout: the package,
    its library and its goldens all come from the wheel (no sources there: the version check only),
    and a BI-mode matmul gives the bits it gives here."""
    import torch

    import titan_audit.batch_invariant as bi

    script = """
import hashlib, json, sys, torch
import titan_audit, titan_audit.batch_invariant as bi
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.demo.stages.goldens import GOLDEN_DIR
g = torch.Generator().manual_seed(0)
a, b = torch.randn(7, 96, generator=g), torch.randn(96, 40, generator=g)
with bi.enabled():
    out = a @ b
print(json.dumps({
    "package": titan_audit.__file__, "lib": str(_lib.LIB_PATH), "sources": _lib.SOURCE_DIR.exists(),
    "isas": _lib.available_isas(), "goldens": str(GOLDEN_DIR),
    "golden_ok": (GOLDEN_DIR / "tiny-dense-bi" / "golden.json").is_file(),
    "bits": hashlib.sha256(out.numpy().tobytes()).hexdigest(),
}))
"""
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("package", "lib", "goldens"):
        assert Path(got[key]).is_relative_to(unpacked), got
    assert got["sources"] is False and got["golden_ok"] and "scalar" in got["isas"]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 96, generator=g), torch.randn(96, 40, generator=g)
    with bi.enabled():
        here = a @ b
    assert got["bits"] == hashlib.sha256(here.numpy().tobytes()).hexdigest()
