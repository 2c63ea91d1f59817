"""`bisect` counts scalar (non-tensor) arguments as inputs and names the phase an op ran in.

Proves: between a run and the same run with `schedule.decay_steps` changed, the first differing op
of step 3 (the first step whose learning rate depends on decay_steps) is AdamW's weight decay
`aten::mul_.Tensor` in the optimizer phase, whose tensor inputs are identical but whose scalar
argument (1 - lr * weight_decay) differs: bisect names both values and says the op is not the
origin (exit 1). Negative controls: the same config twice is identical (exit 0), and a forward op
with an identical scalar and a differing tensor input still says "its inputs already differ".
Two empty op logs are bad input (exit 2, one line).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from titan_audit.audit import compare_op_logs, read_op_log, record_op_log
from titan_audit.audit.oplog import OPLOG_SCHEMA
from titan_audit.cli.main import cli
from titan_audit.trainer.config import load_config
from titan_audit.trainer.optim import OptimizerConfig, ScheduleConfig, lr_at
from titan_audit.trainer.train import train

# warmup 1: steps 1..2 have the same lr for any decay_steps (progress 0 at step 2), step 3 does not
SMALL = [
    "steps=3",
    "checkpoint.interval=3",
    "data.global_batch_size=1",
    "data.seq_len=32",
    "data.synthetic_records=256",
    "schedule.warmup_steps=1",
    "parallel.threads=1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("bisect-scalars")
    for name, extra in (("a", []), ("again", []), ("decay", ["schedule.decay_steps=7"])):
        train(load_config("tiny-dense", [*SMALL, *extra]), root / name, quiet=True, oplog_step=3)
    torch.set_num_threads(threads)
    return root


def _bisect(*args):
    return CliRunner().invoke(cli, ["bisect", *map(str, args)])


def test_changed_decay_steps_is_a_scalar_argument_of_the_optimizer(runs):
    result = _bisect(runs / "a", runs / "decay", "--step", "3", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert (data["kind"], data["op"], data["module"], data["phase"]) == ("output", "aten::mul_.Tensor", "", "optimizer")
    assert data["tensor_inputs_identical"] is True and data["inputs_identical"] is False
    # the scalar is AdamW's 1 - lr * weight_decay, with lr from each run's schedule at step 3
    wd = 0.1
    lr_a = lr_at(2, OptimizerConfig(lr=3e-3, weight_decay=wd), ScheduleConfig(warmup_steps=1), 3)
    lr_b = lr_at(2, OptimizerConfig(lr=3e-3, weight_decay=wd), ScheduleConfig(warmup_steps=1, decay_steps=7), 3)
    assert lr_a != lr_b
    assert data["differing_scalars"] == [{"argument": "args[1]", "a": repr(1 - lr_a * wd), "b": repr(1 - lr_b * wd)}]
    text = _bisect(runs / "a", runs / "decay", "--step", "3")
    assert text.exit_code == 1
    first = text.output.splitlines()[0]
    assert "aten::mul_.Tensor outside any module (optimizer)" in first
    assert f"args[1]: {1 - lr_a * wd!r} in A, {1 - lr_b * wd!r} in B" in first
    assert "this op is not the origin" in first and "learning rate" in first
    assert "not reproducible" not in text.output and "(forward)" not in text.output


def test_phases_of_a_training_step(runs):
    rows = read_op_log(runs / "a" / "oplogs" / "step_3.parquet")
    phases = {r["phase"] for r in rows}
    assert phases == {"forward", "backward", "optimizer", "other"}
    assert all(r["module"] == "" for r in rows if r["phase"] in ("optimizer", "other"))
    assert all(r["module"] for r in rows if r["phase"] == "forward")
    # the optimizer's ops come last: nothing of forward or backward runs after the optimizer step
    last_other = max(i for i, r in enumerate(rows) if r["phase"] in ("forward", "backward"))
    first_optim = min(i for i, r in enumerate(rows) if r["phase"] == "optimizer")
    assert last_other < first_optim


def test_negative_control_same_config_is_identical(runs):
    result = _bisect(runs / "a", runs / "again", "--step", "3")
    assert result.exit_code == 0, result.output
    assert "identical" in result.output


def _net_step(factor: float, bump: bool = False):
    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 3)
    if bump:
        with torch.no_grad():
            fc.bias[0] = torch.nextafter(fc.bias[0], torch.tensor(1.0))
    x = torch.randn(2, 4)
    return lambda: (fc(x) * factor).sum()


def test_scalar_vs_tensor_input_differences(tmp_path):
    _, a = record_op_log(_net_step(2.0), tmp_path / "a", "s")
    _, b = record_op_log(_net_step(2.0000002), tmp_path / "b", "s")
    _, c = record_op_log(_net_step(2.0, bump=True), tmp_path / "c", "s")
    scalar = compare_op_logs(a, b)
    assert (scalar.op, scalar.phase, scalar.inputs_identical, scalar.tensor_inputs_identical) == (
        "aten::mul.Tensor",
        "other",
        False,
        True,
    )
    assert scalar.differing_scalars == [{"argument": "args[1]", "a": "2.0", "b": "2.0000002"}]
    assert "scalar argument differs (args[1]: 2.0 in A, 2.0000002 in B)" in scalar.cause
    tensor = compare_op_logs(a, c)  # negative control: the scalar is the same, a tensor input is not
    assert (tensor.op, tensor.phase, tensor.inputs_identical, tensor.differing_scalars) == (
        "aten::addmm",
        "forward",
        False,
        [],
    )
    assert tensor.cause.startswith("its inputs already differ")


def test_version_1_logs_without_scalars_still_compare(tmp_path):
    _, a = record_op_log(_net_step(2.0), tmp_path / "a", "s")
    _, b = record_op_log(_net_step(2.0000002), tmp_path / "b", "s")
    for path in (a, b):
        table = pq.read_table(path).drop_columns(["scalar_paths", "scalar_values"])
        pq.write_table(table, path)
    result = compare_op_logs(a, b)
    assert result.scalars_recorded is False and result.tensor_inputs_identical is True
    assert "do not record scalar arguments" in result.cause


def test_two_empty_op_logs_are_bad_input(tmp_path):
    _, a = record_op_log(lambda: None, tmp_path / "a", "s")
    _, b = record_op_log(lambda: None, tmp_path / "b", "s")
    assert pq.read_schema(a).names == OPLOG_SCHEMA.names and not read_op_log(a)
    result = _bisect(a, b)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
    assert str(a) in result.output and "neither op log holds a single op" in result.output
