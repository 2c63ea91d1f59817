"""Checkpoints: exact round trip, atomic saves, corruption refused, fallback, retention, resharding."""

import json

import pytest
import torch
from distributed import run_ranks

from titan_audit.audit import fingerprint_many
from titan_audit.trainer.checkpoint import Checkpointer, CorruptCheckpointError


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _state_hashes(model, optimizer):
    hashes = fingerprint_many(model.state_dict())
    for i, state in optimizer.state_dict()["state"].items():
        hashes.update({f"{i}.{k}": h for k, h in fingerprint_many(state).items()})
    return hashes


def test_round_trip_then_resume_matches_uninterrupted_training(tmp_path):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, 3)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, model, optimizer, {"data": {"epoch": 0, "step": 3}})
    _train(model, optimizer, 2, start=3)

    resumed, resumed_opt = _model_and_optimizer(seed=1)  # different init: the load must overwrite it
    assert ckpt.load_latest(resumed, resumed_opt) == {"format": 1, "step": 3, "data": {"epoch": 0, "step": 3}}
    _train(resumed, resumed_opt, 2, start=3)
    assert _state_hashes(resumed, resumed_opt) == _state_hashes(model, optimizer)

    control, control_opt = _model_and_optimizer(seed=1)  # negative control: no load, other result
    _train(control, control_opt, 2, start=3)
    assert _state_hashes(control, control_opt) != _state_hashes(model, optimizer)


def _flip_a_weight_byte(ckpt_dir, weight):
    raw = weight.detach().numpy().tobytes()
    for path in (ckpt_dir / "model_optim").glob("*.distcp"):
        data = bytearray(path.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + 5] ^= 0x01
            path.write_bytes(bytes(data))
            return
    raise AssertionError("weight bytes not found in the checkpoint files")


def test_flipped_byte_is_refused_and_fallback_uses_the_previous(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = Checkpointer(tmp_path)
    _train(model, optimizer, 1)
    ckpt.save(1, model, optimizer, {})
    _train(model, optimizer, 1, start=1)
    ckpt.save(2, model, optimizer, {})
    _flip_a_weight_byte(ckpt.path(2), model[0].weight)

    fresh, fresh_opt = _model_and_optimizer()
    with pytest.raises(
        CorruptCheckpointError, match=r"step_00000002.*do not match hashes.json, first model\.0\.weight"
    ):
        ckpt.load(2, fresh, fresh_opt)
    assert ckpt.load_latest(fresh, fresh_opt, fallback=True)["step"] == 1


def test_truncated_file_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, 1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer, {})
    for path in (ckpt.path(1) / "model_optim").glob("*.distcp"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="step_00000001"):
        ckpt.load(1, *_model_and_optimizer())


def test_incomplete_checkpoint_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer, {})
    (ckpt.path(1) / "hashes.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="hashes.json: missing"):
        ckpt.load(1, *_model_and_optimizer())


def test_interrupted_save_is_invisible_and_cleaned_by_the_next_save(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer, {})
    leftover = ckpt.root / ".step_00000002.partial"
    leftover.mkdir()
    (leftover / "junk").write_text("half written")
    assert ckpt.steps() == [1]
    ckpt.save(2, model, optimizer, {})
    assert ckpt.steps() == [1, 2] and not leftover.exists()


def test_retention_keeps_the_last_k_and_existing_steps_are_not_overwritten(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, model, optimizer, {})
    assert ckpt.steps() == [2, 3]
    with pytest.raises(ValueError, match="already exists"):
        ckpt.save(3, model, optimizer, {})
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)


def test_newer_format_and_bad_json_are_clear_errors(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer, {})
    trainer = ckpt.path(1) / "trainer.json"
    trainer.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="newer titan-audit"):
        ckpt.load(1, model, optimizer)
    trainer.write_text("{oops")
    with pytest.raises(CorruptCheckpointError, match="trainer.json: not valid JSON"):
        ckpt.load(1, model, optimizer)


def _save_on_ranks(rank, world_size, run_dir):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, 2)
    Checkpointer(run_dir).save(2, model, optimizer, {"world_size": world_size})
    return _state_hashes(model, optimizer)


def _load_on_ranks(rank, world_size, run_dir):
    model, optimizer = _model_and_optimizer(seed=5)
    state = Checkpointer(run_dir).load_latest(model, optimizer)
    return state, _state_hashes(model, optimizer)


@pytest.mark.slow
def test_saved_at_two_ranks_loads_at_one_and_four(tmp_path):
    saved = run_ranks(_save_on_ranks, 2, args=(str(tmp_path),))
    assert saved[0] == saved[1]
    for world_size in (1, 4):
        for state, hashes in run_ranks(_load_on_ranks, world_size, args=(str(tmp_path),)):
            assert state["world_size"] == 2 and hashes == saved[0]
