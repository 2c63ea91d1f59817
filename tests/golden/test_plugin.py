"""The pytest plugin, as another project would use it: its own rootdir, its own golden directory
(ini `golden_dir`), its own training function (`run=`), the marker and the fixture forms.
Each scenario is a pytest subprocess that loads the plugin through its pytest11 entry point, as an
installed titan-audit does (in-process pytester cannot re-import torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROJECT_TEST = textwrap.dedent('''
    import json
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest
    import torch

    from titan_audit import deterministic
    from titan_audit.audit import Recorder


    def my_train(out):
        """A stand-in for another project's trainer: 2 steps of a tiny model, audited."""
        out.mkdir(parents=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=float(os.environ.get("MY_LR", "0.1")))
        recorder = Recorder(out, model, level="params")
        rows = []
        for step in (1, 2):
            recorder.start_step(step)
            recorder.set_microbatch(0)
            x = torch.randn(4, 3)
            recorder.record_data(x)
            loss = model(x).square().mean()
            recorder.record_loss(loss)
            loss.backward()
            recorder.set_microbatch(-1)
            recorder.record_grads()
            optimizer.step()
            optimizer.zero_grad()
            recorder.record_params()
            recorder.end_step()
            rows.append({"step": step, "loss": float(loss.detach())})
        recorder.close()
        pq.write_table(pa.Table.from_pylist(rows), out / "metrics.parquet")
        fingerprint = deterministic.fingerprint("cpu").to_dict()
        fingerprint["torch_version"] = os.environ.get("MY_TORCH", fingerprint["torch_version"])
        manifest = {"config": {"lr": optimizer.param_groups[0]["lr"]}, "fingerprint": fingerprint}
        (out / "manifest.json").write_text(json.dumps(manifest))


    def test_fixture_form(golden_run):
        result = golden_run("mine", run=my_train)
        assert result.passed


    @pytest.mark.golden("mine", run=my_train)
    def test_marker_form(golden_run):
        assert golden_run.passed  # also under --golden-update (a GoldenUpdate)
''')


@pytest.mark.slow
def test_plugin_in_another_project(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pytest.ini").write_text(
        "[pytest]\ngolden_dir = goldens\naddopts = --strict-markers -p no:cacheprovider\n"
    )
    (project / "test_mine.py").write_text(PROJECT_TEST)
    outside = tmp_path / "elsewhere"

    def run(*args: str, **env: str):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", *args],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        return proc.returncode, proc.stdout + proc.stderr

    # --golden-dir overrides the ini option; a missing golden fails and says how to create it
    ret, out = run("--golden-dir", str(outside))
    assert ret == 1, out
    assert f"no golden {outside / 'mine'}" in out and "--golden-update" in out

    ret, out = run("--golden-update")  # both forms' `.passed` bodies hold while recording
    assert ret == 0 and "2 passed" in out, out
    assert (project / "goldens" / "mine" / "golden.json").is_file()
    assert "recorded" in out and "unchanged (not rewritten)" in out

    ret, out = run()
    assert ret == 0, out
    assert "2 passed" in out and "GoldenToleranceWarning" not in out

    # negative control: another learning rate changes the parameters after step 1
    ret, out = run(MY_LR="0.2")
    assert ret == 1, out
    assert "golden check failed (exact mode)" in out
    assert "first divergence: step 1, phase param, microbatch -1, name weight" in out

    # another numerics fingerprint: passes in tolerance mode, loudly; fails where exactness is required
    ret, out = run(MY_TORCH="0.0.0+other")
    assert ret == 0, out
    assert "GoldenToleranceWarning" in out and "TOLERANCE mode, not bitwise" in out and "torch_version" in out
    ret, out = run("--golden-require-exact", MY_TORCH="0.0.0+other")
    assert ret == 1 and "exact comparison required" in out, out

    # a corrupt golden fails the test as corrupt
    part = project / "goldens" / "mine" / "metrics.parquet"
    part.write_bytes(part.read_bytes()[:-1])
    ret, out = run()
    assert ret == 1 and "corrupt golden" in out, out
