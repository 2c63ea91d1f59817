"""The run engine (trainer/run.py) as both loops use it, called from Python (no launcher):

- `rl_train(...)` takes the run lock for the whole run: another process that tries to write the
  run meanwhile is refused, naming this process; after the run the lock is free (control);
- the RL manifest's numerics fingerprint is taken under the run's own numerics:
  `batch_invariant: true` in a BI run, false in a native one (control);
- a run that fails mid-way is closed anyway: lock released, BI mode and the deterministic
  switches restored, and the manifest of a resumed run untouched (nothing half-written).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit import batch_invariant, deterministic
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.config import load_rl_config
from titan_audit.rl.loop import rl_train

TINY = ["steps=1", "task.prompts_per_step=2", "task.samples_per_prompt=2", "sampling.max_new_tokens=4"]
TRY_LOCK = "import sys; from titan_audit.audit.run_lock import lock_existing_run; lock_existing_run(sys.argv[1])"


def _try_lock(out: Path) -> subprocess.CompletedProcess:
    """Another process tries to take the run's lock."""
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(out)], capture_output=True, text=True, timeout=120)


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_rl_train_from_python_holds_the_run_lock_and_fingerprints_under_bi(tmp_path):
    out = tmp_path / "rl"
    seen = {}

    def factory(model, bi):  # called inside the run, after the engine's set-up
        seen["other process"] = _try_lock(out)
        return BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=bi, max_batch_size=4))

    rl_train(load_rl_config("rl-tiny", TINY), out, quiet=True, generator_factory=factory)
    refused = seen["other process"]
    assert refused.returncode != 0 and "is writing this run" in refused.stderr, refused.stderr
    free = _try_lock(out)  # negative control: the lock goes with the run
    assert free.returncode == 0, free.stderr
    manifest = _manifest(out)
    assert manifest["kind"] == "rl" and manifest["fingerprint"]["batch_invariant"] is True
    assert manifest["world_size_history"][-1]["mesh"] == {"device_type": "cpu", "dp": 1, "tp": 1}


def test_native_fingerprint_and_a_failing_resume_is_closed(tmp_path):
    out = tmp_path / "rl"
    rl_train(load_rl_config("rl-tiny", [*TINY, "determinism.batch_invariant=false"]), out, quiet=True)
    assert _manifest(out)["fingerprint"]["batch_invariant"] is False  # control of the test above
    before = (out / "manifest.json").read_bytes()
    switches = deterministic.switches.Switches.read()

    def broken(model, bi):
        raise RuntimeError("generator failed to start")

    config = load_rl_config("rl-tiny", [*TINY, "steps=2", "determinism.batch_invariant=false"])
    with pytest.raises(RuntimeError, match="generator failed to start"):
        rl_train(config, out, resume=True, quiet=True, generator_factory=broken)
    assert deterministic.switches.Switches.read() == switches
    assert (out / "manifest.json").read_bytes() == before  # a failed resume wrote nothing
    # a BI run that fails after its set-up (BI mode on, lock held): both undone
    with pytest.raises(RuntimeError, match="generator failed to start"):
        rl_train(load_rl_config("rl-tiny", TINY), tmp_path / "bi", quiet=True, generator_factory=broken)
    assert not batch_invariant.is_enabled()
    assert _try_lock(out).returncode == 0 and _try_lock(tmp_path / "bi").returncode == 0  # locks released
