"""Op-level logs through PyTorch's DebugMode, and the first aten op at which two logs part.

    result, path = record_op_log(lambda: train_step(batch), run_dir, "step_7")
    comparison = compare_op_logs(run_a / "oplogs/step_7.parquet", run_b / "oplogs/step_7.parquet")

Guarantees:
- `record_op_log` runs a callable under `torch.utils._debug_mode.DebugMode` with
  `record_nn_module=True` and `DebugMode.log_tensor_hashes(hash_fn=audit.fingerprint,
  hash_inputs=True)`: every aten op on real tensors (forward and backward) is logged in execution
  order with the xxh3-128 fingerprint of each output and input tensor (raw bits, as everywhere in
  titan-audit), the op's arguments as DebugMode renders them, the exact value of
  every non-tensor argument (`scalar_paths` / `scalar_values`: `args[1]`, `alpha`, ... with
  Python's round-trip `repr`, so a learning rate that differs in its last bit shows), and where it
  ran: `module`, the innermost module of DebugMode's ModTracker at that moment, and `phase`:
  `backward` (inside autograd's backward), `optimizer` (inside any `torch.optim.Optimizer.step`,
  seen through torch's global step hooks), `forward` (inside a module's forward), else `other`
  (outside any module, backward and optimizer step: a loss computed outside the model, gradient
  reduction, clipping). Module paths are ModTracker's: the root module's class name, then the
  `named_modules` path.
- The log is saved as `RUN/oplogs/<label>.parquet`, atomically (temp + rename), and never
  overwritten (an existing label is a ValueError).
- `compare_op_logs` walks two logs in order. If the sequences of ops part (another op at the
  same index, or one log ends early), that is reported as a structural divergence at that index.
  Otherwise the first op whose output fingerprints differ is named, with its module path and
  phase, and with whether its inputs were identical in both logs. Inputs are the tensor arguments
  (by hash) and the scalar ones (by value): identical inputs and different outputs mean that op
  itself is not reproducible; a differing tensor input means the difference came in from outside
  the recorded region (an input, a parameter) and this is its first consumer; a differing scalar
  argument (both values given in `differing_scalars`) means the op is not the origin either: the
  value was computed upstream, outside the logged ops (e.g. the optimizer's learning rate from
  the schedule). `cause` says which, in words.
- Two logs without a single op are bad input (ValueError), never "identical".
- Op logs written before scalar arguments were recorded still read; their scalars count as
  unknown (`scalars_recorded` False) and only tensor inputs are compared.
- Per-rank: on a DTensor program each rank logs the ops on its local tensors; compare the logs of
  the same rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from titan_audit.audit.fingerprint import fingerprint

OPLOG_DIR = "oplogs"
OPLOG_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64(), nullable=False),  # position among the logged ops
        pa.field("op", pa.string(), nullable=False),  # e.g. aten::addmm
        pa.field("module", pa.string(), nullable=False),  # innermost module ("" outside any)
        pa.field("phase", pa.string(), nullable=False),  # forward | backward
        pa.field("depth", pa.int32(), nullable=False),
        pa.field("call", pa.string(), nullable=False),  # DebugMode's rendering, without hashes
        pa.field("output_paths", pa.list_(pa.string()), nullable=False),
        pa.field("output_hashes", pa.list_(pa.string()), nullable=False),
        pa.field("input_hashes", pa.list_(pa.string()), nullable=False),
        pa.field("scalar_paths", pa.list_(pa.string()), nullable=False),  # non-tensor arguments: args[1], alpha
        pa.field("scalar_values", pa.list_(pa.string()), nullable=False),  # their values (repr)
    ],
    metadata={b"titan-audit.oplog": b"2"},
)
_SCALAR_COLUMNS = ("scalar_paths", "scalar_values")  # absent from version-1 logs
OPLOG_PHASES = ("forward", "backward", "optimizer", "other")


_PLAIN = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _scalar_text(value: Any) -> str:
    """A number as its exact round-trip repr, a dtype/device/... as str; any other object (a
    Generator, a SymInt) by its type alone: its repr would name a memory address."""
    if isinstance(value, (bool, int, float, complex)):
        return repr(value)
    if isinstance(value, _PLAIN):
        return str(value)
    return f"<{type(value).__name__}>"


def _scalars(args: Any, kwargs: Any) -> tuple[list[str], list[str]]:
    """(paths, values) of an op call's non-tensor arguments: `args[1]`, `alpha`, ...; values as
    `_scalar_text`. None arguments are skipped."""
    paths, values = [], []
    for prefix, tree in (("args", tuple(args)), ("kwargs", dict(kwargs or {}))):
        flat, _ = tree_flatten_with_path(tree)
        for path, leaf in flat:
            if leaf is None or isinstance(leaf, torch.Tensor):
                continue
            key = keystr(path)
            if prefix == "kwargs":  # "['alpha']" -> "alpha", "['size'][0]" -> "size[0]"
                name, _, rest = key[2:].partition("']")
                paths.append(name + rest)
            else:
                paths.append(prefix + key)
            values.append(_scalar_text(leaf))
    return paths, values


def _hash(value: Any) -> str | None:
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and not value.is_meta:
        return fingerprint(value)
    return None


def _flat_hashes(tree: Any) -> tuple[list[str], list[str]]:
    flat, _ = tree_flatten_with_path(tree)
    paths, hashes = [], []
    for path, leaf in flat:
        if leaf is not None:
            paths.append(keystr(path))
            hashes.append(str(leaf))
    return paths, hashes


def oplog_path(run_dir: str | os.PathLike, label: str) -> Path:
    if not label or "/" in label or label.startswith("."):
        raise ValueError(f"invalid op-log label {label!r}: use a plain file name such as 'step_7'")
    return Path(run_dir) / OPLOG_DIR / f"{label}.parquet"


RERUN_HINT = (
    "give two run directories (and no --log) to have step {step} re-run from their checkpoints "
    "(trainer.op_bisect), or record op logs with titan_audit.audit.record_op_log(fn, RUN, 'step_{step}')"
)


def find_op_log(target: str | os.PathLike, label: str | None = None, step: int | None = None) -> Path:
    """The op log meant by `target`: the file itself, or RUN/oplogs/<label>.parquet of a run
    (label defaults to `step_<step>`, else to the run's only op log); ValueError otherwise."""
    target = Path(target)
    if target.is_file():
        return target
    if not target.is_dir():
        raise ValueError(f"{target}: no such op log or run directory")
    if label is None and step is not None:
        label = f"step_{step}"
    if label is not None:
        path = oplog_path(target, label)
        if path.is_file():
            return path
        if step is not None:
            raise ValueError(f"{path}: no recorded op log; " + RERUN_HINT.format(step=step))
        raise ValueError(f"{path}: no such op log")
    logs = sorted((target / OPLOG_DIR).glob("*.parquet"))
    if len(logs) == 1:
        return logs[0]
    if not logs:
        raise ValueError(f"{target}: no op logs ({OPLOG_DIR}/*.parquet not found); pass op-log files or --step")
    raise ValueError(f"{target}: several op logs ({', '.join(p.stem for p in logs)}); choose one with --log NAME")


def record_op_log(fn: Callable[[], Any], run_dir: str | os.PathLike, label: str) -> tuple[Any, Path]:
    """Run `fn()` under DebugMode with xxh3 op hashing; save the log to RUN/oplogs/<label>.parquet."""
    with op_log(run_dir, label) as path:
        result = fn()
    return result, path


@contextlib.contextmanager
def op_log(run_dir: str | os.PathLike, label: str) -> Iterator[Path]:
    """`record_op_log` as a context manager: the ops run inside the block are logged, and the log
    is saved to the yielded path when the block exits normally (nothing is written on an error)."""
    from torch.utils._debug_mode import DebugMode, _OpCall

    path = oplog_path(run_dir, label)
    if path.exists():
        raise ValueError(f"{path}: an op log with this label exists; op logs are never overwritten")
    mode = DebugMode(record_nn_module=True, record_tensor_attributes=[], record_output=True)
    tracker = mode.module_tracker
    assert tracker is not None

    in_optimizer = [0]  # nesting depth of Optimizer.step calls (any optimizer)

    def where(func, types, args, kwargs, result) -> dict[str, Any]:
        parents = [p for p in tracker.parents if p != "Global"]
        innermost = max(parents, key=lambda p: (p.count("."), len(p)), default="")
        if tracker.is_bw:
            phase = "backward"
        elif in_optimizer[0]:
            phase = "optimizer"
        else:
            phase = "forward" if innermost else "other"
        paths, values = _scalars(args, kwargs)
        return {"module": innermost, "phase": phase, "scalar_paths": paths, "scalar_values": values}

    def enter_step(*_: Any) -> None:
        in_optimizer[0] += 1

    def leave_step(*_: Any) -> None:
        in_optimizer[0] = max(in_optimizer[0] - 1, 0)

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    handles = [register_optimizer_step_pre_hook(enter_step), register_optimizer_step_post_hook(leave_step)]
    try:
        with (
            mode,
            DebugMode.dispatch_hooks(record_hook=where),
            DebugMode.log_tensor_hashes(hash_fn=_hash, hash_inputs=True),
        ):
            yield path
    finally:
        for handle in handles:
            handle.remove()

    columns: dict[str, list] = {name: [] for name in OPLOG_SCHEMA.names}
    index = 0
    for call in mode.operators:
        if not isinstance(call, _OpCall) or not call.log or "hash" not in call.log:
            continue
        log = call.log
        out_paths, out_hashes = _flat_hashes(log["hash"])
        _, in_hashes = _flat_hashes(log.get("input_hash", ()))
        info = call.record or {}
        rendering = call.render([])
        columns["index"].append(index)
        columns["op"].append(_op_name(call.op))
        columns["module"].append(info.get("module", ""))
        columns["phase"].append(info.get("phase", "other"))
        columns["depth"].append(call.call_depth)
        columns["call"].append(rendering.split("  # {", 1)[0])
        columns["output_paths"].append(out_paths)
        columns["output_hashes"].append(out_hashes)
        columns["input_hashes"].append(in_hashes)
        columns["scalar_paths"].append(info.get("scalar_paths", []))
        columns["scalar_values"].append(info.get("scalar_values", []))
        index += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(pa.Table.from_pydict(columns, schema=OPLOG_SCHEMA), f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _op_name(op: Any) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return op.name()
    return getattr(op, "__qualname__", None) or str(op)


def read_op_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a saved op log; ValueError naming the file when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such op log")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
    missing = [n for n in OPLOG_SCHEMA.names if n not in table.schema.names and n not in _SCALAR_COLUMNS]
    if missing:
        raise ValueError(f"{path}: not an op log (missing columns {', '.join(missing)})")
    rows = table.to_pylist()
    if any(c not in table.schema.names for c in _SCALAR_COLUMNS):  # a version-1 log: scalars unknown
        for row in rows:
            row["scalar_paths"] = row["scalar_values"] = None
    return rows


@dataclass
class OpLogComparison:
    log_a: str
    log_b: str
    ops_a: int
    ops_b: int
    identical: bool
    kind: str | None  # None (identical), "structure" or "output"
    index: int | None
    op: str | None
    module: str | None
    phase: str | None  # forward | backward | optimizer | other (OPLOG_PHASES)
    inputs_identical: bool | None  # tensor inputs (hashes) and scalar arguments (values)
    differing_outputs: list[str]
    call_a: str | None
    call_b: str | None
    differing_ops: int
    tensor_inputs_identical: bool | None = None
    differing_scalars: list[dict[str, Any]] = field(default_factory=list)  # {"argument", "a", "b"}
    scalars_recorded: bool = True  # False for op logs written before scalars were recorded
    cause: str | None = None  # what the first difference means, in words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scalar_differences(ra: dict[str, Any], rb: dict[str, Any]) -> list[dict[str, Any]]:
    pa_, pb = ra["scalar_paths"] or [], rb["scalar_paths"] or []
    va, vb = ra["scalar_values"] or [], rb["scalar_values"] or []
    a, b = dict(zip(pa_, va)), dict(zip(pb, vb))
    order = list(dict.fromkeys([*pa_, *pb]))
    return [{"argument": k, "a": a.get(k), "b": b.get(k)} for k in order if a.get(k) != b.get(k)]


_UPSTREAM = {
    "optimizer": "the optimizer's learning rate from the schedule, or another hyper-parameter",
    "backward": "a loss scale or another number computed in Python",
    "forward": "a config value or another number computed in Python",
    "other": "a config value or another number computed in Python",
}


def _cause(phase: str, tensors_same: bool, scalars: list[dict[str, Any]], recorded: bool) -> str:
    if not tensors_same:
        return (
            "its inputs already differ: the difference came from outside the recorded ops "
            "(this op is the first to read it)"
        )
    if scalars:
        shown = "; ".join(f"{d['argument']}: {d['a']} in A, {d['b']} in B" for d in scalars[:3])
        noun = "argument differs" if len(scalars) == 1 else "arguments differ"
        upstream = _UPSTREAM.get(phase, _UPSTREAM["other"])
        return (
            f"its tensor inputs are bitwise identical, but its scalar {noun} ({shown}): this op is not the "
            f"origin; the value was computed upstream, outside the logged ops (e.g. {upstream})"
        )
    if not recorded:
        return (
            "its tensor inputs are bitwise identical in both logs (these logs do not record scalar arguments): "
            "this op is not reproducible, or a scalar argument differs"
        )
    return "its inputs (tensors and scalar arguments) are bitwise identical in both logs: this op is not reproducible"


def compare_op_logs(path_a: str | os.PathLike, path_b: str | os.PathLike) -> OpLogComparison:
    """The first op at which two op logs part (see the module docstring)."""
    a, b = read_op_log(path_a), read_op_log(path_b)
    if not a and not b:
        raise ValueError(
            f"{path_a} and {path_b}: neither op log holds a single op; nothing to compare "
            "(record the ops of a step with titan_audit.audit.op_log, or bisect --step N on two runs)"
        )
    base = {"log_a": str(path_a), "log_b": str(path_b), "ops_a": len(a), "ops_b": len(b)}
    recorded = all(r["scalar_paths"] is not None for r in (a[:1] + b[:1]))
    first: dict[str, Any] | None = None
    differing = 0
    for i, (ra, rb) in enumerate(zip(a, b)):
        if ra["op"] != rb["op"] or ra["module"] != rb["module"] or ra["output_paths"] != rb["output_paths"]:
            return OpLogComparison(
                **base,
                identical=False,
                kind="structure",
                index=i,
                op=f"{ra['op']} vs {rb['op']}",
                module=ra["module"] if ra["module"] == rb["module"] else f"{ra['module']} vs {rb['module']}",
                phase=ra["phase"],
                inputs_identical=None,
                differing_outputs=[],
                call_a=ra["call"],
                call_b=rb["call"],
                differing_ops=differing,
                scalars_recorded=recorded,
                cause="the op sequences part: the two runs ran different code here (another op, module or outputs)",
            )
        if ra["output_hashes"] != rb["output_hashes"]:
            differing += 1
            if first is None:
                outs = [
                    p for p, ha, hb in zip(ra["output_paths"], ra["output_hashes"], rb["output_hashes"]) if ha != hb
                ]
                tensors_same = ra["input_hashes"] == rb["input_hashes"]
                scalars = _scalar_differences(ra, rb) if recorded else []
                first = dict(
                    kind="output",
                    index=i,
                    op=ra["op"],
                    module=ra["module"],
                    phase=ra["phase"],
                    inputs_identical=tensors_same and not scalars,
                    differing_outputs=outs,
                    call_a=ra["call"],
                    call_b=rb["call"],
                    tensor_inputs_identical=tensors_same,
                    differing_scalars=scalars,
                    scalars_recorded=recorded,
                    cause=_cause(ra["phase"], tensors_same, scalars, recorded),
                )
    if first is None and len(a) != len(b):
        i = min(len(a), len(b))
        longer = a if len(a) > len(b) else b
        return OpLogComparison(
            **base,
            identical=False,
            kind="structure",
            index=i,
            op=f"{'A' if len(a) > len(b) else 'B'} continues with {longer[i]['op']}; the other log ends",
            module=longer[i]["module"],
            phase=longer[i]["phase"],
            inputs_identical=None,
            differing_outputs=[],
            call_a=a[i]["call"] if i < len(a) else None,
            call_b=b[i]["call"] if i < len(b) else None,
            differing_ops=differing,
            scalars_recorded=recorded,
            cause="one log ends before the other: the two runs ran different code",
        )
    if first is None:
        return OpLogComparison(
            **base,
            identical=True,
            kind=None,
            index=None,
            op=None,
            module=None,
            phase=None,
            inputs_identical=None,
            differing_outputs=[],
            call_a=None,
            call_b=None,
            differing_ops=0,
            scalars_recorded=recorded,
        )
    return OpLogComparison(**base, identical=False, differing_ops=differing, **first)
