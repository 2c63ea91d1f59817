"""The demo (the README's main job) passes end to end, and its checks can fail."""

import subprocess
import sys

import pytest

from titan_audit import demo


def test_decode_check_holds_with_bi_ops_and_fails_with_native_ops():
    assert demo.decode_matches_full_forward(bi=True)
    assert not demo.decode_matches_full_forward(bi=False)  # negative control


@pytest.mark.slow
def test_demo_command_exits_0_and_every_stage_passes(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "titan_audit.cli", "demo", "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo passed: every guarantee held" in proc.stdout
    assert "negative control, plain all_reduce at W=2: differs" in proc.stdout
    assert (out / "golden" / "golden.json").is_file()


def test_demo_refuses_an_existing_out_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "titan_audit.cli", "demo", "--out", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
