"""Recorder.counters (bytes hashed, bytes received) and the batched step-level records: a batch
(record_params / record_grads / record_optimizer / record_many) writes the rows one call per
tensor writes, hashed together; the counters add up the bytes of the records hashed."""

import pytest
import torch

from titan_audit.audit import Recorder
from titan_audit.audit.summary import summarize


def _model_and_optimizer():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 12))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randn(5, 24, generator=g)
    model(ids).square().mean().backward()
    opt.step()
    return model, opt, ids


def _step_records(recorder, model, opt, ids, *, batched: bool):
    recorder.start_step(3)
    recorder.set_microbatch(0)
    recorder.record_data(ids)
    recorder.set_microbatch(-1)
    if batched:
        recorder.record_grads()
        recorder.record_optimizer(opt)
        recorder.record_params()
        recorder.record_many("ckpt", {"w": model[0].weight, "nested": {"b": model[2].bias}})
    else:  # the same records, one call per tensor (no batch)
        for name, p in model.named_parameters():
            recorder.record("grad", name, p.grad)
        for name, p in model.named_parameters():
            for key, value in opt.state[p].items():
                recorder.record("optim", f"{name}.{key}", value)
        for name, p in model.named_parameters():
            recorder.record("param", name, p)
        recorder.record("ckpt", "w", model[0].weight)
        recorder.record("ckpt", "nested.b", model[2].bias)


def test_batched_rows_are_the_one_by_one_rows_and_counters_add_their_bytes(tmp_path):
    model, opt, ids = _model_and_optimizer()
    rows = {}
    for batched in (True, False):
        recorder = Recorder(tmp_path / str(batched), model, level="params")
        _step_records(recorder, model, opt, ids, batched=batched)
        rows[batched] = list(recorder._rows)
        tensors = [ids] + [p.grad for p in model.parameters()]
        tensors += [v for p in model.parameters() for v in opt.state[p].values()]
        tensors += list(model.parameters()) + [model[0].weight, model[2].bias]
        assert recorder.counters.hashed_bytes == sum(t.nbytes for t in tensors)
        assert recorder.counters.received_bytes == 0 and recorder.counters.lattice_records == 0
        recorder.close()
    assert rows[True] == rows[False]
    assert all(row is not None for row in rows[True])
    param_rows = [r for r in rows[True] if r[1] == "param"]
    assert [r[6] for r in param_rows] == [summarize(p, with_stats=False).hash for p in model.parameters()]


def test_control_a_changed_parameter_moves_its_row_only(tmp_path):
    model, opt, ids = _model_and_optimizer()
    rows = []
    for run in range(2):
        if run:
            with torch.no_grad():
                model[2].weight[3, 4] += 1.0
        recorder = Recorder(tmp_path / str(run), model, level="params")
        recorder.start_step(0)
        recorder.record_params()
        rows.append(list(recorder._rows))
        recorder.close()
    changed = [a[3] for a, b in zip(*rows) if a != b]
    assert changed == ["2.weight"]


def test_an_error_inside_a_batch_keeps_the_plain_records_made_before_it(tmp_path):
    recorder = Recorder(tmp_path, level="params")
    recorder.start_step(0)
    state = {"a": torch.ones(3), "b": torch.zeros(2), "c": torch.empty(3, device="meta")}
    with pytest.raises(NotImplementedError, match="meta tensor"):
        recorder.record_many("ckpt", state)
    assert [r[3] for r in recorder._rows] == ["a", "b"]
    assert recorder._rows[0][6] == summarize(state["a"], with_stats=False).hash
    assert recorder.counters.hashed_bytes == 12 + 8
    recorder.close()
