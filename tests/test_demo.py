"""The demo (the README's main job) passes, and its determinism check can fail."""

import subprocess
import sys

from titan_audit import demo


def test_tiny_training_is_bitwise_repeatable_and_seed_sensitive():
    a, b, other = demo.train_tiny(0, steps=2), demo.train_tiny(0, steps=2), demo.train_tiny(1, steps=2)
    assert a.param_hashes == b.param_hashes
    assert a.param_hashes[0] != other.param_hashes[0]  # negative control


def test_tiny_training_is_identical_in_a_fresh_process():
    code = "from titan_audit import demo; print(demo.train_tiny(0, steps=2).param_hashes)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(demo.train_tiny(0, steps=2).param_hashes)


def test_demo_command_exits_0():
    proc = subprocess.run([sys.executable, "-m", "titan_audit.cli", "demo"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo passed" in proc.stdout
