"""The kernel battery for arm64 (the portable scalar variant, cross-compiled with
g++-aarch64-linux-gnu, linked statically) under qemu-user reproduces the x86 hashes of the kernel
golden exactly: every case, threads 1 and 2.

Skips, with the install command, where the cross toolchain or the emulator is missing (`.ci/run`
installs both). Builds the harness with `make battery-aarch64` first (a no-op when it is fresh).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from titan_audit.portability import battery, kernel_golden

pytestmark = pytest.mark.arm64


def _need_toolchain() -> None:
    missing = [tool for tool in ("aarch64-linux-gnu-g++", "qemu-aarch64") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found; install with: {battery.CROSS_INSTALL}")


def test_the_arm64_battery_under_qemu_reproduces_the_x86_hashes() -> None:
    _need_toolchain()
    build = subprocess.run(
        ["make", "-s", "battery-aarch64"], cwd=battery.ROOT, capture_output=True, text=True, timeout=900
    )
    assert build.returncode == 0, build.stdout + build.stderr
    elf = battery.HARNESS["aarch64"].read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183, "an AArch64 executable (EM_AARCH64)"
    result = kernel_golden.check(kernel_golden.DEFAULT_PATH, arch="aarch64")
    assert result["passed"], "\n".join(kernel_golden.check_report(result))
    r = result["sections"]["kernels"]
    assert result["arch"] == "aarch64" and r["variants"] == ["scalar"] and r["threads"] == [1, 2]
    assert r["cases"] == len(kernel_golden.load(kernel_golden.DEFAULT_PATH)["kernels"]["cases"])
    assert result["sections"]["torch_ops"] == {"checked": False}
