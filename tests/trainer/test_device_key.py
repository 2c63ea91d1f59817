"""`parallel.device` (cpu | cuda) and `--device`: the key, its checks, and runs on each device.

On any machine (fast, no marker):
- the key defaults to "cpu" in the train and RL configs, refuses anything else naming
  `parallel.device`, and a config saved before it existed reads as "cpu" (no config difference,
  no resume difference; "cuda" is one: control);
- `--device X` on train and rl is `--set parallel.device=X`, given after the --set options;
- `--device cuda` (train, rl, verify-onpolicy, replay) on a machine without CUDA: exit 2, one line
  naming `parallel.device`, no traceback, no run directory;
- `backend = "auto"` resolves by the device alone (nccl for cuda, gloo for cpu), also where CUDA
  is visible; nccl with cpu and gloo with cuda are refused naming both keys; a CPU mesh on a
  machine that shows CUDA joins a gloo group on a CPU mesh; the vLLM generator is refused on cuda;
- a CPU run's manifest says cpu (config, mesh, fingerprint); a run recorded as cuda replays on the
  CPU (`replay --device cpu`: its checkpoint loads there, the replay's manifest says cpu);
- on cpu moving a microbatch moves nothing.

On a CUDA machine (marker `gpu`, skipped elsewhere; scripts/gpu_check.sh runs them):
- G1: a BI tiny-dense run on cuda, twice: `compare` finds every record identical; control: the
  same run in the other gemm order (`determinism.bi_kernels = "v1"`: tiny-dense's gemms over
  K = 256 and 768 sum in one chain instead of 4 and 8 blocks) differs;
- G5: the cuda run's checkpoint resumes bitwise (a replay from step 1 on cuda is identical), and
  replays on the CPU (runs to the end; its manifest says cpu);
- G4: `verify-onpolicy --config rl-tiny --steps 2 --set parallel.device=cuda` shows a zero gap;
  control: the constructed control run beside it (--control: the generator sent the trainer's
  weights one ulp off, rl/control.py) has tokens that differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from command_line import cli_here, one_line_error

from titan_audit.audit.config_diff import config_changes
from titan_audit.data.microbatch import TENSOR_FIELDS, Microbatch
from titan_audit.rl.config import RLConfig, load_rl_config
from titan_audit.trainer import typed_config
from titan_audit.trainer.checks import check_backend
from titan_audit.trainer.config import ProcessSection, TrainConfig, load_config, resume_differences, to_dict
from titan_audit.trainer.mesh import init_mesh, resolve_backend
from titan_audit.trainer.replay import elastic_replay
from titan_audit.trainer.train import train

CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(CUDA, reason="this machine has CUDA: --device cuda would run")

TINY = ["steps=2", "checkpoint.interval=1", "data.synthetic_records=256"]


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _config(**parallel) -> TrainConfig:
    return load_config("tiny-dense", [f"parallel.{k}={v}" for k, v in parallel.items()])


# ---------------------------------------------------------------------------------- the key
def test_the_key_defaults_to_cpu_and_refuses_other_devices():
    assert ProcessSection().device == "cpu"
    assert TrainConfig().parallel.device == "cpu" and RLConfig().parallel.device == "cpu"
    assert load_config("tiny-dense").parallel.device == "cpu"
    assert _config(device="cuda").parallel.device == "cuda"  # a valid value (checked against the machine later)
    assert load_rl_config("rl-tiny", ["parallel.device=cuda"]).parallel.device == "cuda"
    with pytest.raises(ValueError, match=r"parallel\.device"):
        _config(device="tpu")
    with pytest.raises(ValueError, match=r"parallel\.device"):
        load_rl_config("rl-tiny", ["parallel.device=mps"])
    with pytest.raises(ValueError, match=r"parallel\.device must be one of 'cpu', 'cuda', got 'gpu'"):
        ProcessSection(device="gpu")


def test_a_config_saved_before_the_key_reads_as_cpu():
    current = load_config("tiny-dense")
    saved = to_dict(current)
    del saved["parallel"]["device"]  # a manifest written before issue 27
    assert typed_config.fill_added_keys(TrainConfig, saved)["parallel"]["device"] == "cpu"
    assert config_changes(saved, to_dict(current)) == []
    assert resume_differences(saved, current) == []
    cuda = _config(device="cuda")  # control: another device is a difference for compare and for a resume
    assert config_changes(saved, to_dict(cuda)) == [("parallel.device", "cpu", "cuda")]
    assert any("parallel.device" in d for d in resume_differences(saved, cuda))


def test_device_option_is_the_set_override_given_last(monkeypatch, tmp_path):
    import titan_audit.trainer.launch as launch

    seen = {}
    monkeypatch.setattr(
        launch, "start", lambda job, source, out, **kw: seen.setdefault(job.kind, kw["overrides"]) and 0
    )
    for command, config in (("train", "tiny-dense"), ("rl", "rl-tiny")):
        proc = cli_here(command, "--config", config, "--out", tmp_path / command, "--set", "parallel.device=cuda")
        assert proc.returncode == 0, proc.stderr
        assert seen.pop(command) == ["parallel.device=cuda"]  # control: no --device, no override of its own
        flags = ("--set", "parallel.device=cuda", "--device", "cpu")
        proc = cli_here(command, "--config", config, "--out", tmp_path / command, *flags)
        assert proc.returncode == 0, proc.stderr
        assert seen[command][-1] == "parallel.device=cpu"  # after the --set options: it wins
    assert load_config("tiny-dense", seen["train"]).parallel.device == "cpu"
    assert load_rl_config("rl-tiny", seen["rl"]).parallel.device == "cpu"
    assert "parallel.device=cpu" not in seen["rl"][:-1]


# ---------------------------------------------------------------------------------- input checks
@NO_CUDA
@pytest.mark.parametrize(
    "command",
    [
        ["train", "--config", "tiny-dense", "--steps", "1"],
        ["rl", "--config", "rl-tiny", "--steps", "1"],
        ["verify-onpolicy", "--config", "rl-tiny", "--steps", "1"],
    ],
    ids=["train", "rl", "verify-onpolicy"],
)
def test_device_cuda_without_cuda_is_one_line_and_writes_nothing(tmp_path, command):
    out = tmp_path / "run"
    line = one_line_error(cli_here(*command, "--out", out, "--device", "cuda"), r"parallel\.device = 'cuda'")
    assert "Traceback" not in line and "none is visible" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []
    same = cli_here(*command, "--out", out, "--set", "parallel.device=cuda")  # the --set spelling: the same line
    assert one_line_error(same, r"parallel\.device") == line


def test_auto_backend_resolves_by_the_device_alone(monkeypatch):
    for visible in (False, True):  # never by torch.cuda.is_available()
        monkeypatch.setattr(torch.cuda, "is_available", lambda visible=visible: visible)
        assert resolve_backend("auto", "cpu") == "gloo"
        assert resolve_backend("auto", "cuda") == "nccl"
        assert resolve_backend("gloo", "cpu") == "gloo" and resolve_backend("nccl", "cuda") == "nccl"


def test_backend_and_device_must_go_together(monkeypatch):
    check_backend(_config())  # control: the default (auto on cpu) passes
    if not CUDA:
        with pytest.raises(ValueError, match=r"parallel\.device = 'cuda' needs a CUDA device"):
            check_backend(_config(device="cuda"))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"parallel\.backend = 'nccl' moves CUDA tensors and parallel\.device = 'cpu'"):
        check_backend(_config(backend="nccl"))
    with pytest.raises(ValueError, match=r"parallel\.backend = 'gloo' moves CPU tensors here and parallel\.device"):
        check_backend(_config(backend="gloo", device="cuda"))
    check_backend(_config(device="cuda"))  # auto on a (seemingly) CUDA machine: nccl, fine
    check_backend(_config(backend="nccl", device="cuda"))


def test_the_vllm_generator_is_refused_on_cuda(monkeypatch):
    from titan_audit.rl.job import check_inputs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"generator = 'vllm' runs vLLM's CPU engine .* parallel\.device = 'cuda'"):
        check_inputs(load_rl_config("rl-tiny", ["generator=vllm", "parallel.device=cuda"]), 1)


@NO_CUDA
def test_a_cuda_mesh_without_a_gpu_names_the_key():
    with pytest.raises(ValueError, match=r"parallel\.device = 'cuda': local rank 0 needs GPU 0 .* 0 visible"):
        init_mesh("auto", device="cuda")


@pytest.mark.skipif(dist.is_initialized(), reason="a process group is already joined in this process")
def test_a_cpu_mesh_where_cuda_is_visible_is_a_gloo_cpu_mesh(monkeypatch):
    from titan_audit.audit.exchange import transport_device
    from titan_audit.trainer.reduce import gather_in_index_order

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # before: auto meant nccl here
    try:
        mesh = init_mesh("auto", device="cpu", single_group=True)
        assert dist.get_backend() == "gloo" and transport_device() == torch.device("cpu")
        assert mesh.device_type == "cpu" and mesh.device == torch.device("cpu")
        assert mesh.to_dict() == {"device_type": "cpu", "dp": 1, "tp": 1}
        assert mesh.fsdp_mesh().device_type == "cpu"  # FSDP2's own default would follow the accelerator
        x = torch.arange(6.0).view(3, 2)
        assert torch.equal(gather_in_index_order(x, 1), x)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_on_cpu_moving_a_microbatch_moves_nothing():
    tensors = {
        name: torch.zeros(1, 4, dtype=torch.bool if name == "loss_mask" else torch.int64) for name in TENSOR_FIELDS
    }
    tensors["sequence_ids"] = torch.zeros(1, dtype=torch.int64)
    mb = Microbatch(0, 0, 3, 8, 5, **tensors)
    moved = mb.to("cpu")
    assert all(getattr(moved, name) is getattr(mb, name) for name in TENSOR_FIELDS)  # no copy
    assert (moved.index, moved.num_microbatches, moved.global_loss_tokens) == (3, 8, 5)


# ---------------------------------------------------------------------------------- a CPU run
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("device") / "run"
    train(load_config("tiny-dense", TINY), out, quiet=True)
    return out


def test_a_cpu_run_records_cpu(cpu_run):
    manifest = _manifest(cpu_run)
    assert manifest["config"]["parallel"]["device"] == "cpu"
    assert manifest["world_size_history"][-1]["mesh"]["device_type"] == "cpu"
    assert manifest["fingerprint"]["device_kind"] == "cpu"


@NO_CUDA
def test_replay_on_cuda_without_cuda_is_one_line(cpu_run, tmp_path):
    out = tmp_path / "replay"
    proc = cli_here("replay", cpu_run, "--from-step", "1", "--device", "cuda", "--out", out)
    one_line_error(proc, r"parallel\.device = 'cuda' needs a CUDA device")
    assert not out.exists()


def test_a_run_recorded_as_cuda_replays_on_the_cpu(cpu_run, tmp_path):
    """What `replay --device cpu` of a cuda run does, on a CPU machine: the run here is a CPU run
    whose manifest says cuda (its checkpoint's tensors are CPU ones; on a GPU machine
    test_cuda_checkpoint_resumes_bitwise_and_replays_on_the_cpu replays a real one)."""
    recorded = tmp_path / "recorded-cuda"
    shutil.copytree(cpu_run, recorded)
    manifest = _manifest(recorded)
    manifest["config"]["parallel"].update(device="cuda", backend="nccl")
    (recorded / "manifest.json").write_text(json.dumps(manifest))
    result, to_step = elastic_replay(recorded, 1, tmp_path / "on-cpu", quiet=True, device="cpu")
    replayed = _manifest(tmp_path / "on-cpu")
    assert replayed["config"]["parallel"]["device"] == "cpu" and replayed["config"]["parallel"]["backend"] == "auto"
    assert replayed["world_size_history"][-1]["mesh"]["device_type"] == "cpu"
    assert to_step == 2 and result.identical and result.compared > 0  # the same CPU bits, step 2
    assert result.config_differences == ["parallel.device: 'cuda' -> 'cpu'"]  # the backend: no difference


# ---------------------------------------------------------------------------------- on a GPU
BI_CUDA = (
    "--config",
    "tiny-dense",
    "--steps",
    "3",
    "--device",
    "cuda",
    "--set",
    "determinism.batch_invariant=true",
    "--set",
    "checkpoint.interval=1",
    "--set",
    "data.synthetic_records=256",
)


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory) -> Path:
    """Two BI tiny-dense runs on cuda (a, b) and the same run in the other gemm order (control)."""
    root = tmp_path_factory.mktemp("cuda")
    for name, extra in (("a", ()), ("b", ()), ("order-v1", ("--set", "determinism.bi_kernels=v1"))):
        proc = cli_here("train", *BI_CUDA, *extra, "--out", root / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_bi_train_twice_is_identical_and_another_gemm_order_differs(cuda_runs):
    manifest = _manifest(cuda_runs / "a")
    assert manifest["config"]["parallel"]["device"] == "cuda"
    assert manifest["world_size_history"][-1]["mesh"]["device_type"] == "cuda"
    assert manifest["fingerprint"]["device_kind"] == "cuda"
    same = cli_here("compare", cuda_runs / "a", cuda_runs / "b", "--json")
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    verdict = json.loads(same.stdout)
    assert verdict["identical"] and verdict["compared"] > 0
    assert _manifest(cuda_runs / "order-v1")["config"]["determinism"]["bi_kernels"] == "v1"
    control = cli_here("compare", cuda_runs / "a", cuda_runs / "order-v1", "--json")
    assert control.returncode == 1, control.stderr[-3000:]  # compare sees the v2 and v1 sums on cuda


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_checkpoint_resumes_bitwise_and_replays_on_the_cpu(cuda_runs, tmp_path):
    resumed, to_step = elastic_replay(cuda_runs / "a", 1, tmp_path / "resumed", quiet=True)
    assert to_step == 3 and resumed.identical and resumed.compared > 0  # G5 on cuda: steps 2-3 bitwise
    assert _manifest(tmp_path / "resumed")["world_size_history"][-1]["mesh"]["device_type"] == "cuda"
    on_cpu, to_step = elastic_replay(cuda_runs / "a", 2, tmp_path / "on-cpu", quiet=True, device="cpu")
    assert to_step == 3 and on_cpu.compared > 0  # the cuda checkpoint loaded into CPU tensors and ran
    replayed = _manifest(tmp_path / "on-cpu")
    assert replayed["config"]["parallel"]["device"] == "cpu"
    assert replayed["world_size_history"][-1]["mesh"]["device_type"] == "cpu"
    assert replayed["fingerprint"]["device_kind"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_verify_onpolicy_has_a_zero_gap(tmp_path):
    out = tmp_path / "g4"
    args = ("--config", "rl-tiny", "--steps", "2", "--set", "parallel.device=cuda", "--control", "--json")
    proc = cli_here("verify-onpolicy", *args, "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = json.loads(proc.stdout)
    assert verdict["zero_gap"] and verdict["tokens_compared"] > 0 and verdict["tokens_differing"] == 0
    assert verdict["control"]["shows_gap"] and verdict["control"]["tokens_differing"] > 0  # the constructed control
    assert verdict["passed"] and _manifest(out / "control")["config"]["control"] == "generator-weight-ulp"
    assert _manifest(out)["world_size_history"][-1]["mesh"]["device_type"] == "cuda"
