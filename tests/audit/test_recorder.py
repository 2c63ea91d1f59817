"""Recorder: levels, module selection, hook naming, explicit records, schema, clean detach."""

import math

import pyarrow as pa
import pytest
import torch
from audit._audit_runs import MODULE_NAMES, PARAM_NAMES, Tiny, train
from torch import nn

from titan_audit.audit import SCHEMA, Recorder, fingerprint, read_audit_log
from titan_audit.audit.schema import DESIGN_COLUMNS


def _rows(run_dir):
    return read_audit_log(run_dir).to_pylist()


def test_schema_has_design_columns_exactly_plus_seq(tmp_path):
    train(tmp_path, steps=1)
    table = read_audit_log(tmp_path)
    assert tuple(table.schema.names[: len(DESIGN_COLUMNS)]) == DESIGN_COLUMNS
    assert table.schema.names == [
        "step",
        "phase",
        "microbatch",
        "name",
        "dtype",
        "shape",
        "hash",
        "absmax",
        "mean",
        "rank",
        "seq",
    ]
    types = {f.name: f.type for f in table.schema}
    assert types["step"] == pa.int64() and types["microbatch"] == pa.int32() and types["rank"] == pa.int32()
    assert types["absmax"] == pa.float64() and types["mean"] == pa.float64() and types["seq"] == pa.int64()
    assert table.schema.equals(SCHEMA, check_metadata=False)


def test_full_level_records_every_phase_and_module(tmp_path):
    train(tmp_path, steps=2, microbatches=2)
    rows = _rows(tmp_path)
    keys = [(r["step"], r["phase"], r["microbatch"], r["name"]) for r in rows]
    assert len(keys) == len(set(keys)), "keys are unique"
    forward = {r["name"] for r in rows if r["phase"] == "forward" and r["step"] == 0 and r["microbatch"] == 0}
    backward = {r["name"] for r in rows if r["phase"] == "backward" and r["step"] == 0 and r["microbatch"] == 0}
    assert forward == set(MODULE_NAMES)
    assert backward == set(MODULE_NAMES)  # every output requires grad (the embedding weight does)
    grads = {r["name"] for r in rows if r["phase"] == "grad" and r["step"] == 1}
    assert grads == set(PARAM_NAMES)
    optim = {r["name"] for r in rows if r["phase"] == "optim" and r["step"] == 1}
    assert optim == {f"{p}.{k}" for p in PARAM_NAMES for k in ("step", "exp_avg", "exp_avg_sq")}
    assert {r["microbatch"] for r in rows if r["phase"] in ("grad", "optim", "param")} == {-1}
    assert {r["phase"] for r in rows} == {"data", "forward", "loss", "backward", "grad", "optim", "param"}
    # seq is the execution order within (step, microbatch): forward children before parents
    mb0 = sorted((r for r in rows if r["step"] == 0 and r["microbatch"] == 0), key=lambda r: r["seq"])
    order = [r["name"] for r in mb0 if r["phase"] == "forward"]
    assert order.index("blocks.0.fc1") < order.index("blocks.0.act") < order.index("blocks.0") < order.index("<root>")
    assert [r["seq"] for r in mb0] == list(range(len(mb0)))


def test_params_level_records_no_activations_and_off_records_nothing(tmp_path):
    train(tmp_path / "params", level="params")
    phases = {r["phase"] for r in _rows(tmp_path / "params")}
    assert phases == {"data", "loss", "grad", "optim", "param"}
    train(tmp_path / "off", level="off")
    assert not (tmp_path / "off" / "audit").exists()


def test_off_installs_no_hooks_and_close_removes_them(tmp_path):
    model = Tiny()
    Recorder(tmp_path, model, level="off")
    assert all(not m._forward_hooks for m in model.modules())
    recorder = Recorder(tmp_path, model, level="full", modules=["blocks.*.fc?"])
    hooked = [name for name, m in model.named_modules() if m._forward_hooks]
    assert hooked == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    recorder.close()
    assert all(not m._forward_hooks for m in model.modules())


def test_module_globs_and_exclude(tmp_path):
    train(tmp_path, steps=1, modules=("blocks.1.*",))
    names = {r["name"] for r in _rows(tmp_path) if r["phase"] == "forward"}
    assert names == {"blocks.1.norm", "blocks.1.fc1", "blocks.1.act", "blocks.1.fc2"}


class _Twice(nn.Module):
    """A module reused within one forward, and a tuple output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(self.lin(x))
        return y, {"double": 2 * y}


def test_repeated_calls_and_structured_outputs_get_unique_names(tmp_path):
    model = _Twice()
    with Recorder(tmp_path, model, level="full") as recorder:
        recorder.start_step(0)
        recorder.set_microbatch(0)
        out, extra = model(torch.ones(2, 3))
        (out.sum() + extra["double"].sum()).backward()
    rows = _rows(tmp_path)
    forward = [r["name"] for r in sorted(rows, key=lambda r: r["seq"]) if r["phase"] == "forward"]
    assert forward == ["lin", "lin@1", "<root>[0]", "<root>[1]['double']"]
    backward = {r["name"] for r in rows if r["phase"] == "backward"}
    assert backward == {"lin", "lin@1", "<root>[0]", "<root>[1]['double']"}


def test_record_values_match_fingerprint_and_stats(tmp_path):
    t = torch.tensor([[1.5, -4.0], [0.25, 2.0]])
    with Recorder(tmp_path, level="params") as recorder:
        recorder.start_step(3)
        recorder.set_microbatch(5)
        recorder.record("logprob", "lp", t)
        recorder.record_checkpoint({"model": {"w": t.bfloat16()}, "epoch": 3})
    rows = {r["name"]: r for r in _rows(tmp_path)}
    lp = rows["lp"]
    assert (lp["step"], lp["phase"], lp["microbatch"], lp["dtype"], lp["shape"]) == (
        3,
        "logprob",
        5,
        "float32",
        "[2, 2]",
    )
    assert lp["hash"] == fingerprint(t)
    assert lp["absmax"] == 4.0 and lp["mean"] == pytest.approx(-0.0625, abs=0)
    ck = rows["model.w"]
    assert (ck["phase"], ck["microbatch"], ck["dtype"], ck["hash"]) == (
        "ckpt",
        -1,
        "bfloat16",
        fingerprint(t.bfloat16()),
    )
    assert "epoch" not in rows


def test_stats_of_special_tensors(tmp_path):
    with Recorder(tmp_path, level="params") as recorder:
        recorder.start_step(0)
        recorder.record("data", "empty", torch.empty(0))
        recorder.record("data", "nan", torch.tensor([1.0, math.nan]))
        recorder.record("data", "ids", torch.tensor([3, -7, 2]))
    rows = {r["name"]: r for r in _rows(tmp_path)}
    assert math.isnan(rows["empty"]["absmax"]) and math.isnan(rows["empty"]["mean"])
    assert math.isnan(rows["nan"]["absmax"])
    assert rows["ids"]["absmax"] == 7.0 and rows["ids"]["mean"] == pytest.approx(-2 / 3)


def test_user_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown audit level"):
        Recorder(tmp_path, level="everything")
    recorder = Recorder(tmp_path, level="params")
    with pytest.raises(ValueError, match="start_step"):
        recorder.record("loss", "loss", torch.ones(()))
    recorder.start_step(0)
    with pytest.raises(ValueError, match="unknown audit phase 'fwd'"):
        recorder.record("fwd", "x", torch.ones(()))
    with pytest.raises(ValueError, match="pass a module"):
        recorder.record_params()


def test_paused_records_nothing_and_flush_cadence(tmp_path):
    model = nn.Linear(2, 2)
    recorder = Recorder(tmp_path, model, level="full", flush_every_steps=2)
    recorder.start_step(0)
    with recorder.paused():
        model(torch.ones(1, 2))
    assert recorder.pending == 0
    model(torch.ones(1, 2))
    assert recorder.pending == 1
    recorder.end_step()  # 1 step since the last flush: nothing written
    recorder.start_step(1)
    model(torch.ones(1, 2))
    recorder.end_step()  # the part is written in the background ...
    assert recorder.pending == 0
    assert recorder.flush() is None  # ... and flush waits for it (nothing else buffered)
    assert [p.name for p in (tmp_path / "audit").glob("part-*")] == ["part-r00000-00000000.parquet"]
    assert read_audit_log(tmp_path).num_rows == 2
    recorder.close()


def test_step_level_records_only_on_replicated_rank(tmp_path):
    model = nn.Linear(2, 2)
    with Recorder(tmp_path, model, level="params", rank=1) as recorder:
        recorder.start_step(0)
        recorder.record_params()  # step level: rank 0 writes these, rank 1 skips
        recorder.set_microbatch(3)
        recorder.record_loss(torch.ones(()))
    rows = _rows(tmp_path)
    assert [(r["phase"], r["rank"], r["microbatch"]) for r in rows] == [("loss", 1, 3)]


def _step_rows(run_dir, model, **kwargs):
    """The rows of one step's record_grads, record_optimizer and record_params (after a step)."""
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(3, model.in_features)).square().sum().backward()
    opt.step()
    with Recorder(run_dir, model, level="params", **kwargs) as recorder:
        recorder.start_step(0)
        recorder.record_grads()
        recorder.record_optimizer(opt)
        recorder.record_params()
    return [tuple(r.values()) for r in _rows(run_dir)]


def test_step_level_calls_in_one_list_are_the_records_made_one_by_one(tmp_path):
    """record_grads / _optimizer / _params take the one-list path when every tensor is a plain
    CPU tensor of at most C (here), and the per-record path otherwise (a dump pattern asked for):
    the same rows, order and seq. Control: one parameter element changed moves that row's hash."""
    from titan_audit.audit.fingerprint import whole_hash_limit

    def build():
        torch.manual_seed(0)
        return nn.Linear(40, 30)

    fast = _step_rows(tmp_path / "fast", build())
    slow = _step_rows(tmp_path / "slow", build(), dump_names=("no-such-name",))
    assert fast == slow and len(fast) == 2 + 3 * 2 + 2  # grads, AdamW's step / exp_avg / exp_avg_sq, params
    assert [r[-1] for r in fast] == list(range(len(fast)))  # seq
    with whole_hash_limit(1024):  # the weight above C: the per-record path with the batch
        mixed = _step_rows(tmp_path / "mixed", build())
    assert [r[:4] + r[-2:] for r in mixed] == [r[:4] + r[-2:] for r in fast]
    changed = build()
    with torch.no_grad():
        changed.bias[0] += 1
    moved = _step_rows(tmp_path / "changed", changed)
    assert [i for i, (a, b) in enumerate(zip(fast, moved)) if a != b] != []
    assert moved[-1][3] == "bias" and moved[-1][6] != fast[-1][6]


def test_stats_policy_default_skips_bulk_step_level_phases(tmp_path):
    model = nn.Linear(2, 2)
    for name, stats in (("default", None), ("all", True), ("none", False)):
        kwargs = {} if stats is None else {"stats": stats}
        with Recorder(tmp_path / name, model, level="params", **kwargs) as recorder:
            recorder.start_step(0)
            recorder.set_microbatch(0)
            recorder.record_loss(torch.tensor(-2.5))
            recorder.record_params()
    rows = {
        name: {r["phase"]: r for r in _rows(tmp_path / name) if r["name"] in ("loss", "weight")}
        for name in ("default", "all", "none")
    }
    assert rows["default"]["loss"]["absmax"] == 2.5 and rows["default"]["param"]["absmax"] is None
    weight = model.weight.detach()
    assert rows["all"]["param"]["absmax"] == float(weight.abs().max())
    assert rows["all"]["param"]["mean"] == pytest.approx(float(weight.double().mean()), rel=1e-6)
    assert rows["none"]["loss"]["absmax"] is None and rows["none"]["loss"]["mean"] is None
    # the hash never depends on the statistics
    assert rows["default"]["param"]["hash"] == rows["all"]["param"]["hash"] == rows["none"]["param"]["hash"]
    with pytest.raises(ValueError, match="unknown audit phase"):
        Recorder(tmp_path / "bad", stats=("forwards",))


def test_activation_checkpointing_does_not_change_the_log(tmp_path):
    from torch.utils.checkpoint import checkpoint

    for name, use_checkpoint in (("plain", False), ("ckpt", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        with Recorder(tmp_path / name, model, level="full") as recorder:
            recorder.start_step(0)
            recorder.set_microbatch(0)
            x = torch.randn(3, 4, requires_grad=True)
            out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
            out.square().sum().backward()
    plain, ckpt = _rows(tmp_path / "plain"), _rows(tmp_path / "ckpt")
    key = lambda r: (r["phase"], r["name"], r["hash"])  # noqa: E731
    assert sorted(map(key, plain)) == sorted(map(key, ckpt))
    assert {r["phase"] for r in ckpt} == {"forward", "backward"}


def test_record_checkpoint_flushes(tmp_path):
    recorder = Recorder(tmp_path, level="params")
    recorder.start_step(4)
    recorder.record_loss(torch.ones(()))
    recorder.record_checkpoint({"w": torch.zeros(2)})
    assert recorder.pending == 0
    assert read_audit_log(tmp_path).num_rows == 2


def test_dumps_only_selected_names_and_steps(tmp_path):
    from titan_audit.audit import list_dumps, read_dump

    model = nn.Linear(2, 2)
    with Recorder(tmp_path, model, level="full", dump_names=["<root>", "bias"], dump_steps=[1]) as recorder:
        for step in range(3):
            recorder.start_step(step)
            recorder.set_microbatch(0)
            model(torch.full((1, 2), float(step)))
            recorder.record_params()
    dumped = sorted((d["step"], d["phase"], d["name"]) for d in list_dumps(tmp_path))
    assert dumped == [(1, "forward", "<root>"), (1, "param", "bias")]
    assert torch.equal(read_dump(tmp_path, 1, "param", -1, "bias"), model.bias.detach())


def test_second_backward_through_the_same_graph_gets_its_own_name(tmp_path):
    model = nn.Linear(2, 2)
    with Recorder(tmp_path, model, level="full") as recorder:
        recorder.start_step(0)
        recorder.set_microbatch(0)
        out = model(torch.ones(1, 2))
        out.sum().backward(retain_graph=True)
        (2 * out.sum()).backward()
    rows = {r["name"]: r for r in _rows(tmp_path) if r["phase"] == "backward"}
    assert set(rows) == {"<root>", "<root>#1"}
    assert rows["<root>"]["hash"] == fingerprint(torch.ones(1, 2))
    assert rows["<root>#1"]["hash"] == fingerprint(torch.full((1, 2), 2.0))


class _Head(nn.Module):
    """The root returns its head's output object: two hooks meet one tensor; `scale_in_place`
    doubles it in place between them (the version counter moves)."""

    def __init__(self, scale_in_place: bool):
        super().__init__()
        self.head = nn.Linear(3, 4)
        self.scale_in_place = scale_in_place

    def forward(self, x):
        y = self.head(x)
        if self.scale_in_place:
            y.mul_(2.0)
        return y


def test_a_tensor_met_twice_in_one_pass_is_hashed_once_unless_changed_in_place(tmp_path, monkeypatch):
    import titan_audit.audit.recorder as recorder_module

    summarized = []
    real_summarize = recorder_module.summarize

    def counting(tensor, *, with_stats=True):
        summarized.append(tuple(tensor.shape))
        return real_summarize(tensor, with_stats=with_stats)

    monkeypatch.setattr(recorder_module, "summarize", counting)
    x = torch.randn(2, 3)
    for scale_in_place in (False, True):
        torch.manual_seed(0)
        model = _Head(scale_in_place)
        run = tmp_path / f"in_place_{scale_in_place}"
        summarized.clear()
        with Recorder(run, model, level="full") as recorder:
            recorder.start_step(0)
            recorder.set_microbatch(0)
            model(x)
        rows = {r["name"]: r for r in _rows(run)}
        head_before = model.head(x).detach()  # the head's output, before any in-place change
        assert rows["head"]["hash"] == fingerprint(head_before)
        if not scale_in_place:  # one object, one version: one summary serves both records
            assert len(summarized) == 1
            assert rows["<root>"]["hash"] == rows["head"]["hash"]
            assert (rows["<root>"]["absmax"], rows["<root>"]["mean"]) == (rows["head"]["absmax"], rows["head"]["mean"])
        else:  # control: the same object changed in place between the hooks is hashed again
            assert len(summarized) == 2
            assert rows["<root>"]["hash"] == fingerprint(2.0 * head_before) != rows["head"]["hash"]


def test_hooks_record_inference_mode_tensors(tmp_path):
    """Inference tensors keep no version counter: recorded, never reused."""
    torch.manual_seed(0)
    model = _Head(scale_in_place=False)
    x = torch.randn(2, 3)
    with Recorder(tmp_path, model, level="full") as recorder:
        recorder.start_step(0)
        recorder.set_microbatch(0)
        with torch.inference_mode():
            out = model(x)
    rows = {r["name"]: r["hash"] for r in _rows(tmp_path)}
    assert rows == {"head": fingerprint(out), "<root>": fingerprint(out)}


def test_explicit_records_are_always_hashed_afresh(tmp_path):
    """A write through `.data` moves no version counter: explicit records never reuse a summary."""
    weight = nn.Parameter(torch.ones(3))
    with Recorder(tmp_path, level="params") as recorder:
        recorder.start_step(0)
        recorder.record("param", "before", weight)
        weight.data.mul_(3.0)
        recorder.record("param", "after", weight)
    rows = {r["name"]: r["hash"] for r in _rows(tmp_path)}
    assert rows["before"] == fingerprint(torch.ones(3)) != rows["after"] == fingerprint(torch.full((3,), 3.0))


def test_end_step_writes_its_part_in_the_background_and_the_next_flush_raises_its_error(tmp_path, monkeypatch):
    """The periodic part is written on the log's background thread; `flush` waits for it (the
    part is there) and raises what writing it raised (a full disk here), not silently."""
    from titan_audit.audit.log import AuditLogWriter

    model = nn.Linear(2, 2)
    recorder = Recorder(tmp_path, model, level="params", flush_every_steps=1)
    recorder.start_step(0)
    recorder.record_params()
    recorder.end_step()
    assert recorder.flush() is None
    assert read_audit_log(tmp_path).num_rows == 2

    def full_disk(self, columns):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(AuditLogWriter, "write", full_disk)
    recorder.start_step(1)
    recorder.record_params()
    recorder.end_step()  # returns at once: the error is the background thread's
    with pytest.raises(OSError, match="No space left on device"):
        recorder.flush()
    monkeypatch.undo()
    recorder.close()
    assert read_audit_log(tmp_path).num_rows == 2
