"""DebugMode op logs: recorded with xxh3 hashes and module paths; the first differing aten op is named."""

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from titan_audit.audit import compare_op_logs, fingerprint, read_op_log, record_op_log
from titan_audit.cli.main import cli


class Scale(nn.Module):
    def __init__(self, factor: float, noise: bool = False) -> None:
        super().__init__()
        self.factor = factor
        self.noise = noise

    def forward(self, x):
        if self.noise:  # the global RNG: the same inputs give other outputs under another seed
            x = x + torch.rand_like(x)
        return x * self.factor


class Net(nn.Module):
    def __init__(self, factor: float = 2.0, noise: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.scale = Scale(factor, noise)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.scale(self.fc1(x))))


def _step(factor: float = 2.0, bump_fc2: bool = False, noise_seed: int | None = None):
    torch.manual_seed(0)
    net = Net(factor, noise=noise_seed is not None)
    if bump_fc2:
        with torch.no_grad():
            net.fc2.bias[0] = torch.nextafter(net.fc2.bias[0], torch.tensor(1.0))
    x = torch.randn(5, 4)

    def step():
        if noise_seed is not None:
            torch.manual_seed(noise_seed)
        loss = net(x).square().mean()
        loss.backward()
        return loss

    return step


def test_log_has_ops_hashes_and_modules(tmp_path):
    loss, path = record_op_log(_step(), tmp_path, "step_0")
    assert path == tmp_path / "oplogs" / "step_0.parquet"
    rows = read_op_log(path)
    addmm = [r for r in rows if r["op"] == "aten::addmm"]
    assert [r["module"] for r in addmm] == ["Net.fc1", "Net.fc2"]
    assert all(r["phase"] == "forward" for r in addmm)
    assert {r["module"] for r in rows if r["phase"] == "backward"} >= {"Net.fc1", "Net.fc2"}
    # the hash is our xxh3 fingerprint of the op's output
    mean = next(r for r in rows if r["op"] == "aten::mean")
    assert mean["output_hashes"] == [fingerprint(loss.detach())]
    assert [r["index"] for r in rows] == list(range(len(rows)))


def test_identical_runs_compare_equal(tmp_path):
    _, a = record_op_log(_step(), tmp_path / "a", "s")
    _, b = record_op_log(_step(), tmp_path / "b", "s")
    result = compare_op_logs(a, b)
    assert result.identical and result.kind is None and result.differing_ops == 0


def test_names_the_op_that_is_not_reproducible(tmp_path):
    # the same inputs (tensors and scalars), another RNG state: aten::rand_like's output differs
    _, a = record_op_log(_step(noise_seed=1), tmp_path / "a", "s")
    _, b = record_op_log(_step(noise_seed=2), tmp_path / "b", "s")
    result = compare_op_logs(a, b)
    assert (result.kind, result.op, result.module, result.phase) == (
        "output",
        "aten::rand_like",
        "Net.scale",
        "forward",
    )
    assert result.inputs_identical is True and result.differing_scalars == []
    assert result.cause.endswith("this op is not reproducible")
    rows = read_op_log(a)
    assert rows[result.index]["op"] == "aten::rand_like"


def test_a_differing_scalar_argument_is_a_differing_input(tmp_path):
    # the same tensors, a different scalar inside Net.scale: aten::mul's scalar argument differs,
    # so the op is not the origin (the number came from outside the logged ops)
    _, a = record_op_log(_step(2.0), tmp_path / "a", "s")
    _, b = record_op_log(_step(2.0000002), tmp_path / "b", "s")
    result = compare_op_logs(a, b)
    assert (result.kind, result.op, result.module, result.phase) == (
        "output",
        "aten::mul.Tensor",
        "Net.scale",
        "forward",
    )
    assert result.inputs_identical is False and result.tensor_inputs_identical is True
    assert result.differing_scalars == [{"argument": "args[1]", "a": "2.0", "b": "2.0000002"}]
    assert "this op is not the origin" in result.cause and "not reproducible" not in result.cause
    rows = read_op_log(a)
    assert rows[result.index]["op"] == "aten::mul.Tensor"
    assert all(r["op"] != "aten::mul.Tensor" for r in rows[: result.index])


def test_names_the_first_consumer_of_a_differing_parameter(tmp_path):
    _, a = record_op_log(_step(), tmp_path / "a", "s")
    _, b = record_op_log(_step(bump_fc2=True), tmp_path / "b", "s")
    result = compare_op_logs(a, b)
    # fc2's bias is consumed first by aten::addmm in Net.fc2; its inputs already differ
    assert (result.op, result.module, result.inputs_identical) == ("aten::addmm", "Net.fc2", False)


def test_structural_divergence(tmp_path):
    _, a = record_op_log(_step(), tmp_path / "a", "s")

    def other():
        torch.manual_seed(0)
        net = Net()
        return net(torch.randn(5, 4)).sum()  # no backward: the log ends early

    _, b = record_op_log(other, tmp_path / "b", "s")
    result = compare_op_logs(a, b)
    assert result.kind == "structure" and not result.identical


def test_never_overwritten_and_bad_files(tmp_path):
    record_op_log(_step(), tmp_path, "s")
    with pytest.raises(ValueError, match="never overwritten"):
        record_op_log(_step(), tmp_path, "s")
    with pytest.raises(ValueError, match="invalid op-log label"):
        record_op_log(_step(), tmp_path, "../x")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="bad.parquet"):
        read_op_log(bad)


def _bisect(*args):
    return CliRunner().invoke(cli, ["bisect", *map(str, args)])


def test_cli_bisect(tmp_path):
    record_op_log(_step(2.0), tmp_path / "a", "step_3")
    record_op_log(_step(2.0000002), tmp_path / "b", "step_3")
    record_op_log(_step(2.0), tmp_path / "c", "step_3")
    result = _bisect(tmp_path / "a", tmp_path / "b", "--step", "3")
    assert result.exit_code == 1, result.output
    assert "aten::mul.Tensor in module Net.scale (forward)" in result.output
    assert "scalar argument differs (args[1]: 2.0 in A, 2.0000002 in B)" in result.output
    assert "not reproducible" not in result.output
    data = json.loads(_bisect(tmp_path / "a" / "oplogs" / "step_3.parquet", tmp_path / "b", "--json").output)
    assert (data["op"], data["module"], data["inputs_identical"]) == ("aten::mul.Tensor", "Net.scale", False)
    assert data["tensor_inputs_identical"] is True
    same = _bisect(tmp_path / "a", tmp_path / "c")
    assert same.exit_code == 0 and "identical" in same.output


def test_cli_bisect_step_on_directories_that_are_not_runs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result = _bisect(tmp_path / "a", tmp_path / "b", "--step", "7")
    assert result.exit_code == 2
    assert str(tmp_path / "a") in result.output
    assert "Traceback" not in result.output
    missing = _bisect(tmp_path / "nope", tmp_path / "b")
    assert missing.exit_code == 2 and "no such op log or run directory" in missing.output
