"""Small run directories for the golden tests, built without the trainer; and where the committed
goldens are (fixture `golden_directory`: titan_audit/goldens/, package data, unless --golden-dir).

`build_run(path, ...)` (fixture `make_run`) trains a tiny nn.Linear for a few steps with the audit
Recorder (phases data, loss, grad, optim, param), writes metrics.parquet and a manifest with this
process's numerics fingerprint (trainer/run_dir.py `write_manifest`). Options perturb it for
negative controls.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titan_audit import deterministic
from titan_audit.audit import AuditLogWriter, Recorder, read_audit_log
from titan_audit.audit.log import part_files
from titan_audit.golden.pytest_plugin import golden_dir
from titan_audit.goldens import GOLDENS_DIR
from titan_audit.trainer.run_dir import write_manifest

STEPS = 3
MAX_STEPS = 8
MICROBATCHES = 2


def build_run(
    path: Path,
    *,
    steps: int = STEPS,
    flip_param_bit_at: int | None = None,
    fingerprint_changes: dict | None = None,
    loss_scale: float = 1.0,
) -> Path:
    """A run of a tiny model. flip_param_bit_at=k: after step k's optimizer step, flip the lowest
    mantissa bit of weight[0, 0] (a one-bit change of one tensor). fingerprint_changes: fields of
    the manifest's numerics fingerprint to replace. loss_scale: multiply the logged loss metric."""
    path.mkdir(parents=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        data = torch.randn(MAX_STEPS, MICROBATCHES, 5, 4)  # step k's data does not depend on `steps`
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    recorder = Recorder(path, model, level="params")
    rows = []
    for step in range(1, steps + 1):
        recorder.start_step(step)
        optimizer.zero_grad()
        total = 0.0
        for mb in range(MICROBATCHES):
            recorder.set_microbatch(mb)
            x = data[step - 1, mb]
            recorder.record_data(x)
            loss = model(x).pow(2).mean() / MICROBATCHES
            recorder.record_loss(loss)
            loss.backward()
            total += float(loss.detach())
        recorder.set_microbatch(-1)
        grad_norm = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
        recorder.record_grads()
        optimizer.step()
        if flip_param_bit_at == step:
            with torch.no_grad():
                model.weight.view(torch.int32)[0, 0] ^= 1
        recorder.record_optimizer(optimizer)
        recorder.record_params()
        recorder.end_step()
        rows.append(
            {"step": step, "loss": total * loss_scale, "grad_norm": grad_norm, "lr": 0.1, "seconds": 0.01 * step}
        )
    recorder.flush()
    recorder.close()
    pq.write_table(pa.Table.from_pylist(rows), path / "metrics.parquet")
    fp = deterministic.fingerprint("cpu").to_dict()
    fp.update(fingerprint_changes or {})
    write_manifest(
        path,
        {
            "config": {"model": "linear-4-3", "steps": steps, "seed": 0},
            "seed": 0,
            "fingerprint": fp,
            "world_size_history": [{"world_size": 1, "start_step": 0}],
        },
    )
    return path


def rewrite_audit(run: Path, transform) -> None:
    """Replace a run's audit log by transform(table) (one part)."""
    table = transform(read_audit_log(run))
    for part in part_files(run):
        part.unlink()
    AuditLogWriter(run).write(table.to_pydict())


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def golden_directory(request) -> Path:
    """The committed goldens ship in the package (titan_audit/goldens/); --golden-dir still wins."""
    return golden_dir(request.config) if request.config.getoption("--golden-dir") else GOLDENS_DIR


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    return build_run(tmp_path_factory.mktemp("golden-base") / "run")


@pytest.fixture
def make_run():
    """`make_run(path, **options)`: see build_run."""
    return build_run


@pytest.fixture
def rewrite_audit_log():
    """`rewrite_audit_log(run, transform)`: see rewrite_audit."""
    return rewrite_audit
