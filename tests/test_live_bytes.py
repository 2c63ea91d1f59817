"""The live-tensor-bytes tracker (titan_audit/live_bytes.py): exact peaks on constructed cases
(each storage once, views free, a freed tensor gone), resizes seen, file mappings apart, autograd's
saved tensors counted; the rank report; and a tracked training run has every bit of an untracked
one (control: a mode in the tracker's place that flips one bit of one op's output is caught)."""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import compare_runs
from titan_audit.live_bytes import MAPPED, LiveBytes, run_tracked
from titan_audit.trainer.config import load_config
from titan_audit.trainer.train import train

F32 = 4


def test_each_storage_counts_once_and_views_are_free():
    with LiveBytes() as tracker:
        a = torch.empty(1000)
        views = [a.view(10, 100), a[100:], a.unsqueeze(0)]
        b = torch.zeros(500)
        assert tracker.live["cpu"] == 1500 * F32
        del a
        assert tracker.live["cpu"] == 1500 * F32  # the views keep its storage
        del views
        assert tracker.live["cpu"] == 500 * F32
        c = b.clone()
        assert tracker.live["cpu"] == 1000 * F32
        del b, c
    assert tracker.live["cpu"] == 0
    assert tracker.peak["cpu"] == 1500 * F32


def test_a_freed_tensor_is_not_counted_while_two_alive_at_once_are():
    with LiveBytes() as tracker:
        first = torch.empty(750)  # 3000 bytes, alone
        del first
        second, third = torch.empty(500), torch.empty(500)  # 2000 + 2000 alive together
        del second, third
    assert tracker.peak["cpu"] == 1000 * F32  # not 750 (the largest alone), not 1750 (all ever made)
    assert tracker.live["cpu"] == 0


def test_a_storage_resized_outside_any_op_is_counted_at_its_new_size():
    """FSDP2 frees and re-allocates its all-gathered parameters with UntypedStorage.resize_."""
    with LiveBytes() as tracker:
        t = torch.empty(1000)
        storage = t.untyped_storage()
        storage.resize_(0)
        assert tracker.live["cpu"] == 0
        storage.resize_(2000 * F32)
        assert tracker.live["cpu"] == 2000 * F32
        t.resize_(3000)  # an op that grows its storage
        assert tracker.live["cpu"] == 3000 * F32
    assert tracker.peak["cpu"] == 3000 * F32
    assert "resize_" not in vars(torch.UntypedStorage)  # the wrapper is gone: torch's own method again


def test_a_file_mapping_counts_apart(tmp_path):
    with LiveBytes() as tracker:
        mapped = torch.from_file(str(tmp_path / "region"), shared=True, size=256, dtype=torch.float32)
        heap = torch.empty(64)
        assert tracker.live == {MAPPED: 256 * F32, "cpu": 64 * F32}
        del mapped, heap
    assert tracker.peak == {MAPPED: 256 * F32, "cpu": 64 * F32}


def test_autograd_saved_tensors_and_gradients_count():
    n = 4096
    with LiveBytes() as tracker:
        x = torch.ones(n, requires_grad=True)
        y = x.exp()  # exp saves its output: y stays alive through the graph once the name is gone
        loss = y.sum()
        del y
        held = tracker.live["cpu"]
        loss.backward()
    scalars = 64  # the loss and the backward's 0-dim seeds, a few bytes each
    assert 2 * n * F32 <= held < 2 * n * F32 + scalars  # x and exp's saved output
    assert 3 * n * F32 <= tracker.peak["cpu"] < 3 * n * F32 + scalars  # and the gradient, at once
    assert x.grad is not None


def test_one_tracker_at_a_time():
    with LiveBytes(), pytest.raises(ValueError, match="one at a time"), LiveBytes():
        pass


def test_run_tracked_writes_the_rank_report(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert run_tracked(lambda n: torch.zeros(n).sum().item(), tmp_path / "ranks")(256) == 0.0
    report = json.loads((tmp_path / "ranks" / "rank-3.json").read_text())
    assert report["rank"] == 3 and report["completed"] is True
    assert report["peak_bytes"]["cpu"] >= 256 * F32 and report["max_rss_bytes"] > 0
    assert set(report["memory_policy"]) == {"mallopt_keeps_freed_heap", "THP_MEM_ALLOC_ENABLE"}

    def fails() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_tracked(fails, tmp_path / "ranks")()
    assert json.loads((tmp_path / "ranks" / "rank-3.json").read_text())["completed"] is False


class FlipsOneBit(LiveBytes):
    """The control: a mode in the tracker's place that flips the last bit of one element of the
    first embedding lookup (step 1, microbatch 0: only the model's forward looks up embeddings)."""

    flipped = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not self.flipped and func is torch.ops.aten.embedding.default:
            out.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
            self.flipped = True
        return out


def _run_rank(rank, world_size, out, overrides, mode_name):
    config = load_config(
        "tiny-dense", ["steps=2", "data.global_batch_size=2", "checkpoint.interval=0", "audit.level='full'", *overrides]
    )
    if mode_name is None:
        train(config, out, quiet=True)
        return None
    mode = {"tracker": LiveBytes, "flip": FlipsOneBit}[mode_name]()
    with mode:
        train(config, out, quiet=True)
    return {"peak": mode.peak.get("cpu", 0), "flipped": getattr(mode, "flipped", False)}


def _run(out, overrides, mode_name=None):
    """One training run in a fresh process (a run leaves its process group and, under FSDP2, the
    packed-weight cache switched off behind it: neither may leak into this test process)."""
    return run_ranks(_run_rank, 1, args=(str(out), overrides, mode_name))[0]


@pytest.mark.parametrize(
    "overrides",
    [[], ["parallel.mode='fsdp'", "determinism.batch_invariant=true"]],
    ids=["dp", "fsdp-bi"],
)
def test_a_tracked_run_has_every_bit_of_an_untracked_one(tmp_path, overrides):
    _run(tmp_path / "plain", overrides)
    tracker = _run(tmp_path / "tracked", overrides, "tracker")
    result = compare_runs(tmp_path / "plain", tmp_path / "tracked")
    assert result.identical and result.compared > 0, result.first_divergence
    assert tracker["peak"] > 0


def test_control_a_mode_that_flips_one_bit_is_caught(tmp_path):
    _run(tmp_path / "plain", [])
    mode = _run(tmp_path / "flipped", [], "flip")
    assert mode["flipped"]
    assert not compare_runs(tmp_path / "plain", tmp_path / "flipped").identical
