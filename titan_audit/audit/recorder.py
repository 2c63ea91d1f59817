"""`Recorder`: per-step fingerprints of a training run's tensors, written to RUN/audit/.

    recorder = Recorder(run_dir, model, level="full", modules=["layers.*"])
    for step in ...:
        recorder.start_step(step)
        for mb in my_microbatches:             # global virtual-microbatch index
            recorder.set_microbatch(mb)
            recorder.record_data(batch)        # phase data
            loss = loss_fn(model(batch))       # forward hooks: phase forward
            recorder.record_loss(loss)         # phase loss
            loss.backward()                    # output-gradient hooks: phase backward
        reduce_gradients(); recorder.record_grads()      # phase grad (step level, microbatch -1)
        optimizer.step(); recorder.record_optimizer(optimizer); recorder.record_params()
        recorder.end_step()                    # flushes every `flush_every_steps` steps
    recorder.flush()                           # at every checkpoint, and at the end
    recorder.close()

Guarantees:
- Works on any `nn.Module` (nothing is assumed about the model): modules are selected by glob
  patterns over `named_modules()` names; the root module is named "<root>".
- Levels: `off` records nothing and installs no hook; `params` records the explicit calls (data,
  rollout, logprob, loss, grad, optim, param, ckpt); `full` adds, for every selected module, the
  fingerprint of its forward output (phase forward) and of the gradient of that output (phase
  backward, via a hook on the output tensor, so the module's autograd graph is not changed).
- Records follow audit.schema (DESIGN.md's columns, plus `seq`, the execution ordinal within
  (step, microbatch)). A module called k > 0 times before in the same (step, microbatch) records
  as `name@k`, so keys stay unique; an output that is a tuple/dict records one name per tensor
  (`name[0]`, `name['logits']`). A backward record carries the step and microbatch of the
  forward that produced the tensor; a k-th further backward through the same output (with
  retain_graph) records as `name#k`. A forward that runs inside backward (activation-checkpoint
  recomputation) is not recorded again, so checkpointing does not change the log.
- Distributed: a record with a microbatch >= 0 is written by the rank that processes that
  microbatch (none with `writes_microbatches=False`: a TP peer of another rank). A step-level
  record (grad, optim, param, ckpt) is written by rank `replicated_rank`, so a DDP run and a
  single-process run log the same records; the other ranks skip a plain tensor's at no cost,
  or, with `split_replicated` (DDP: every rank holds the same tensors), take their share of
  those above C: each hashes 1/W of the dim-0 rows and sends 40 bytes. A DTensor is recorded as
  its logical tensor (the same record at any DP / FSDP2 / TP layout) without `full_tensor()`:
  each rank hashes the piece it holds (audit.fingerprint's lattice digest above C bytes; a
  tensor of at most C is gathered to the writer and hashed whole), in one exchange per mesh
  for all the records of one call (record_grads, record_params, record_optimizer,
  record_many). These are collectives: every rank of the mesh (of the world, for
  `split_replicated`) makes the same record calls in the same order; a step-level record is
  written by `replicated_rank` (a mesh without it exchanges nothing), another by the lowest
  rank of the mesh. absmax is exact; mean's last bits may depend on the layout
  (summary.summarize_sharded). A dumped DTensor (`dump_names`) is gathered whole.
- Records are buffered in memory and written as one atomic Parquet part per flush (audit.log),
  so a crash loses at most the records since the last flush; call `flush()` at every checkpoint.
  `end_step`'s periodic part is written on a background thread; `flush` and `close` wait for it,
  and an error writing it is raised by the next end_step, flush or close.
- Opening a run whose audit log has parts (a resume appends to it) reads back the parts of its
  rank it appends to (audit.log says which): a damaged one raises ValueError naming it before
  anything is appended. Older parts stand on their digests in the index (`titan-audit verify
  RUN` reads every part), so opening costs the same however long the run.
- Optionally (`dump_names`, `dump_steps`) full tensor values go to RUN/dumps.zarr (audit.dumps).
- `absmax`/`mean` (informational, never compared) for the phases in `stats` (default: all but
  grad, optim, param and ckpt, where the statistics kernel would add a pass over the model's
  memory each step; `stats=True` for all); elsewhere null.
- On a GPU a plain tensor's record does not wait: queued there, read at end_step / flush.
- Cost: a few microseconds of Python per record. A call that records many tensors hashes its
  plain CPU tensors of at most C bytes (no statistics) in one kernel call on every intra-op
  thread (summary.summarize_batch; the same rows, order and `seq`), with no call per record
  when this rank writes them all. A hook record of a tensor recorded in the same (step,
  microbatch), its version counter unchanged, reuses that summary. `counters`
  (audit.exchange.DigestCounters) counts the bytes this rank hashed and received.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_audit.audit.dumps import DumpWriter
from titan_audit.audit.exchange import DigestCounters, rank_and_world
from titan_audit.audit.fingerprint import whole_hash_bytes
from titan_audit.audit.hooks import ModuleHooks
from titan_audit.audit.log import AuditLogWriter
from titan_audit.audit.pieces import is_dtensor
from titan_audit.audit.schema import PHASES, SCHEMA, check_phase
from titan_audit.audit.summary import (
    Later,
    Summary,
    batch_digests,
    batch_meta,
    batch_metas,
    read_back,
    summarize,
    summarize_batch,
    summarize_later,
    summarize_sharded,
    summarized_later,
)

LEVELS = ("off", "params", "full")
STEP_LEVEL = -1
_HOOK_PHASES = ("forward", "backward")
# absmax/mean by default for everything but the bulk step-level phases (every parameter, its
# gradient and optimizer state each step): there they would add the statistics kernel's pass
# (~0.6x the hash) over the model's memory to every step of the `params` level.
DEFAULT_STATS_PHASES = ("rollout", "data", "forward", "logprob", "loss", "backward")


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_RECENT_SUMMARIES = 8  # hook records whose summary a second record of the same tensor can reuse
LATER_BYTES = 64 << 20  # what queued device records may hold (Later.held) before they are read back
# A record is one tuple: step, phase, microbatch, name, the Summary's fields, rank, seq.
assert SCHEMA.names[4:9] == list(Summary._fields), "Summary's fields must be SCHEMA's columns 4-8"


class Recorder(ModuleHooks):
    """Records fingerprints of a run's tensors per step (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        module: torch.nn.Module | None = None,
        *,
        level: str = "params",
        modules: Iterable[str] = ("*",),
        exclude: Iterable[str] = (),
        rank: int | None = None,
        replicated_rank: int = 0,
        writes_microbatches: bool = True,
        split_replicated: bool = False,
        flush_every_steps: int = 50,
        stats: bool | Iterable[str] = DEFAULT_STATS_PHASES,
        dump_names: Iterable[str] = (),
        dump_steps: Iterable[int] | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"unknown audit level {level!r}; choose one of {', '.join(LEVELS)}")
        if flush_every_steps < 1:
            raise ValueError(f"flush_every_steps must be >= 1, got {flush_every_steps}")
        self.run_dir = Path(run_dir)
        self.level = level
        process_rank, world = rank_and_world()
        self.rank = process_rank if rank is None else rank
        self.replicated_rank = replicated_rank
        self.writes_microbatches = writes_microbatches
        self.split_replicated = split_replicated and world > 1
        self.flush_every_steps = flush_every_steps
        self.stats_phases = frozenset(PHASES if stats is True else () if stats is False else stats)
        for phase in self.stats_phases:
            check_phase(phase)
        self.patterns = tuple(modules)
        self.exclude = tuple(exclude)
        self.dump_names = tuple(dump_names)
        self.dump_steps = None if dump_steps is None else frozenset(dump_steps)
        self.module = module
        self.step: int | None = None
        self.microbatch = STEP_LEVEL
        self._paused = False
        self._recent: dict[tuple[int, bool], tuple[weakref.ref, int, Summary | Later]] = {}  # (id, with_stats)
        self._rows: list[tuple] = []  # one tuple per record, in SCHEMA's column order
        # DTensor (and split replicated) records of the current batch (slot in _rows or None, the
        # row's fields, the item for summarize_sharded), summarised together when the batch ends
        self._pending: list[tuple[int | None, tuple, tuple]] | None = None
        # plain records of the current batch that summary.summarize_batch takes (slot in _rows,
        # the row's fields, the tensor, its batch_meta), hashed together when the batch ends
        self._deferred: list[tuple[int, tuple, torch.Tensor, Any]] | None = None
        self._later: list[tuple[int, tuple, Later]] = []  # device records not read yet: slot, fields, Later
        self._later_bytes = 0  # what they hold (Later.held)
        self.counters = DigestCounters()  # bytes this rank hashed and received for its records
        self._seq: dict[int, int] = {}
        self._calls: dict[tuple[int, str], int] = {}
        self._steps_since_flush = 0
        self._handles: list[Any] = []
        self._param_names: dict[int, str] = {}
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._writer: AuditLogWriter | None = None
        self._dumps: DumpWriter | None = None
        if level != "off":  # the parts a resume appends to are read back first: never append to a damaged one
            self._writer = AuditLogWriter(self.run_dir, rank=self.rank, verify=True)
        if module is not None:
            self._params = list(module.named_parameters())
            self._param_names = {id(p): name for name, p in self._params}
            if level == "full":
                self._attach_hooks(module)

    # ----------------------------------------------------------------- driving the recorder
    def start_step(self, step: int) -> None:
        """Begin step `step`: the microbatch goes back to -1 (step level)."""
        self.step = int(step)
        self.microbatch = STEP_LEVEL
        self._seq.clear()
        self._calls.clear()
        self._recent.clear()

    def set_microbatch(self, microbatch: int) -> None:
        """The global virtual-microbatch index the following records belong to (-1: step level)."""
        if microbatch < STEP_LEVEL:
            raise ValueError(f"microbatch must be >= -1, got {microbatch}")
        self.microbatch = int(microbatch)
        self._recent.clear()

    def end_step(self) -> None:
        """End the step; every `flush_every_steps` steps the buffered records go to a part
        written in the background (audit.log's `submit`; `flush` waits for it)."""
        self._steps_since_flush += 1
        self._read_later()
        if self._steps_since_flush >= self.flush_every_steps:
            self._steps_since_flush = 0
            if self._writer is not None and self._rows:
                assert self._pending is None, "end_step() inside a batch of DTensor records"
                self._writer.submit(self._rows)
                self._rows = []

    def flush(self) -> Path | None:
        """Write the buffered records as one atomic part, after the one `end_step` began; its path."""
        self._steps_since_flush = 0
        if self._writer is None:
            return None
        self._read_later()
        self._writer.wait()
        if not self._rows:
            return None
        assert self._pending is None, "flush() inside a batch of DTensor records"
        path = self._writer.write_rows(self._rows)
        self._rows = []
        return path

    def close(self) -> None:
        """Flush and remove every hook; the module is left as it was found."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.flush()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside (e.g. evaluation passes between training steps)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    @property
    def pending(self) -> int:
        """Records buffered since the last flush."""
        return len(self._rows)

    # ----------------------------------------------------------------- explicit records
    def record(self, phase: str, name: str, tensor: torch.Tensor, *, microbatch: int | None = None) -> None:
        """Record one tensor under (current step, phase, microbatch, name)."""
        check_phase(phase)
        if not self._active(phase):
            return
        self._record(phase, name, tensor, self.microbatch if microbatch is None else microbatch, self._current_step())

    def record_many(
        self, phase: str, tensors: Mapping[str, Any], *, prefix: str = "", microbatch: int | None = None
    ) -> None:
        """Record every tensor of a (nested) mapping as `prefix + dotted.path`; other values skipped."""
        check_phase(phase)
        if not self._active(phase):
            return
        step = self._current_step()
        mb = self.microbatch if microbatch is None else microbatch
        with self._batch():
            for name, tensor in _flatten(tensors, prefix):
                self._record(phase, name, tensor, mb, step)

    def record_data(self, batch: torch.Tensor | Mapping[str, Any], name: str = "input_ids") -> None:
        """The microbatch's data: a tensor (token ids) or a mapping of tensors (phase data)."""
        if isinstance(batch, Mapping):
            self.record_many("data", batch)
        else:
            self.record("data", name, batch)

    def record_loss(self, loss: torch.Tensor, name: str = "loss") -> None:
        self.record("loss", name, loss)

    def record_logprobs(self, logprobs: torch.Tensor, name: str = "logprobs") -> None:
        self.record("logprob", name, logprobs)

    def record_rollout(self, name: str, tensor: torch.Tensor) -> None:
        self.record("rollout", name, tensor)

    def record_params(self, module: torch.nn.Module | None = None) -> None:
        """Every parameter of the module (phase param, step level)."""
        if self._active("param"):
            self._record_step("param", list(self._named_parameters(module)))

    def record_grads(self, module: torch.nn.Module | None = None) -> None:
        """Every parameter's .grad after reduction (phase grad, step level); None grads skipped."""
        if self._active("grad"):
            self._record_step("grad", [(n, p.grad) for n, p in self._named_parameters(module) if p.grad is not None])

    def record_optimizer(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> None:
        """Optimizer state after the step (phase optim, step level): `param_name.state_key`."""
        if not self._active("optim"):
            return
        names = self._param_names if module is None else {id(p): n for n, p in module.named_parameters()}
        named = []
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                pname = names.get(id(param), f"group{g}.param{i}")
                state = optimizer.state.get(param, {}).items()
                named += [(f"{pname}.{key}", value) for key, value in state if isinstance(value, torch.Tensor)]
        self._record_step("optim", named)

    def record_checkpoint(self, state: Mapping[str, Any], prefix: str = "", *, flush: bool = True) -> None:
        """Every tensor of a checkpoint's (nested) state dict (phase ckpt, step level), then (by
        default) a flush, so a crash after the checkpoint loses no record from before it."""
        self.record_many("ckpt", state, prefix=prefix, microbatch=STEP_LEVEL)
        if flush:
            self.flush()

    # ----------------------------------------------------------------- internals
    def _active(self, phase: str) -> bool:
        if self.level == "off" or self._paused:
            return False
        return self.level == "full" or phase not in _HOOK_PHASES

    def _current_step(self) -> int:
        if self.step is None:
            raise ValueError("Recorder: call start_step(step) before recording")
        return self.step

    def _named_parameters(self, module: torch.nn.Module | None):
        if module is not None:
            return module.named_parameters()
        if self.module is None:
            raise ValueError("Recorder: pass a module (to the Recorder or to this call) to record its parameters")
        return self._params  # the Recorder's module's parameters, listed once at construction

    def _record(self, phase: str, name: str, tensor: torch.Tensor, microbatch: int, step: int) -> None:
        if type(tensor) not in _PLAIN_TYPES and is_dtensor(tensor):
            self._record_shared(phase, name, tensor, microbatch, step)
            return
        if microbatch == STEP_LEVEL and self.split_replicated and tensor.nbytes > whole_hash_bytes():
            self._record_shared(phase, name, tensor, microbatch, step)  # every rank hashes its share
            return
        if microbatch == STEP_LEVEL and self.rank != self.replicated_rank:
            return
        if microbatch != STEP_LEVEL and not self.writes_microbatches:
            return
        seq = self._seq.get(microbatch, 0)
        self._seq[microbatch] = seq + 1
        meta = None
        if self._deferred is not None and phase not in self.stats_phases and phase not in _HOOK_PHASES:
            meta = batch_meta(tensor)
        if meta is not None:  # inside a batch: the slot now, the hash with the batch's others
            self._deferred.append((len(self._rows), (step, phase, microbatch, name, seq), tensor, meta))
            self._rows.append(None)
        else:
            summary = self._summarize(phase, tensor)
            if type(summary) is not Later:  # SCHEMA's order: step, phase, microbatch, name, dtype, shape, hash, ...
                self._rows.append((step, phase, microbatch, name, *summary, self.rank, seq))
            else:  # its row when it is read back
                self._later.append((len(self._rows), (step, phase, microbatch, name, seq), summary))
                self._rows.append(None)
                self._later_bytes += summary.held
                self._read_later(beyond=LATER_BYTES)
        if self._dump_wanted(name, step):
            self._dump(step, phase, microbatch, name, tensor)

    def _record_step(self, phase: str, named: list[tuple[str, torch.Tensor]]) -> None:
        """Step-level records of `named` in order, the rows (and `seq`) _record makes one by one.
        When this rank writes them all, none is dumped and each is a plain CPU tensor of at most
        C without statistics: one kernel call (summary.batch_digests) and no call per record."""
        step = self._current_step()
        metas = tensors = None
        if self.rank == self.replicated_rank and phase not in self.stats_phases and not self.dump_names:
            tensors = [tensor for _, tensor in named]
            metas = batch_metas(tensors)
        if metas is None or self._deferred is not None:
            with self._batch():
                for name, tensor in named:
                    self._record(phase, name, tensor, STEP_LEVEL, step)
            return
        seq = self._seq.get(STEP_LEVEL, 0)
        self._seq[STEP_LEVEL] = seq + len(named)
        digests = batch_digests(tensors, metas, torch.get_num_threads())
        rank = self.rank
        # SCHEMA's order, as _record's rows (no statistics: the phase is not in stats_phases)
        self._rows += [
            (step, phase, STEP_LEVEL, n, m.dtype, m.shape, d, None, None, rank, seq + i)
            for i, ((n, _), m, d) in enumerate(zip(named, metas, digests))
        ]
        self.counters.hashed_bytes += sum(meta.nbytes for meta in metas)

    def _record_shared(self, phase: str, name: str, tensor: torch.Tensor, microbatch: int, step: int) -> None:
        """A DTensor's record (or a replicated plain tensor's, `split_replicated`) from the ranks'
        pieces (module doc): its row's slot is taken now (the row order and `seq` are those of an
        unsharded run) and filled when the batch ends."""
        if microbatch == STEP_LEVEL:
            dst, writes = self.replicated_rank, self.rank == self.replicated_rank
        else:
            dst = int(tensor.device_mesh.mesh.min())  # a plain tensor comes here at step level only
            writes = self.writes_microbatches and dist.get_rank() == dst
        slot, fields = None, ()
        if writes:
            seq = self._seq.get(microbatch, 0)
            self._seq[microbatch] = seq + 1
            slot, fields = len(self._rows), (step, phase, microbatch, name, seq)
            self._rows.append(None)  # filled by _summarize_pending
        entry = (slot, fields, (tensor, phase in self.stats_phases, dst))
        if self._dump_wanted(name, step):
            full = tensor.full_tensor() if is_dtensor(tensor) else tensor  # collective for a DTensor
            if writes:
                self._dump(step, phase, microbatch, name, full)
        if self._pending is None:
            self._summarize_pending([entry])
        else:
            self._pending.append(entry)

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        """DTensor records made inside are summarised together at the end (one exchange)."""
        if self._pending is not None:  # nested: the outer batch summarises
            yield
            return
        self._pending, self._deferred = [], []
        try:
            yield
        except BaseException:  # no exchange: drop the DTensor slots; the plain records made stand
            self._pending = None
            deferred, self._deferred = self._deferred, None
            self._summarize_deferred(deferred)
            self._read_later()
            self._rows = [row for row in self._rows if row is not None]
            raise
        pending, self._pending = self._pending, None
        deferred, self._deferred = self._deferred, None
        self._summarize_deferred(deferred)
        self._summarize_pending(pending)

    def _summarize_deferred(self, deferred: list[tuple[int, tuple, torch.Tensor, Any]]) -> None:
        """The batch's deferred plain records: one summarize_batch over their tensors on every
        intra-op thread. Only the Recorder's own loop ran between their record calls and here,
        so the bytes hashed are those the calls were given."""
        if not deferred:
            return
        tensors = [item[2] for item in deferred]
        summaries = summarize_batch(tensors, [item[3] for item in deferred], torch.get_num_threads())
        for (slot, (step, phase, microbatch, name, seq), _, meta), summary in zip(deferred, summaries):
            self._rows[slot] = (step, phase, microbatch, name, *summary, self.rank, seq)
            self.counters.hashed_bytes += meta.nbytes

    def _read_later(self, beyond: int = -1) -> None:
        """Fill the rows of the device records queued so far, if they hold more than `beyond`."""
        if self._later and self._later_bytes > beyond:
            later, self._later, self._later_bytes = self._later, [], 0
            for (slot, (step, phase, mb, name, seq), _), summary in zip(later, read_back([i[2] for i in later])):
                self._rows[slot] = (step, phase, mb, name, *summary, self.rank, seq)

    def _summarize_pending(self, pending: list[tuple[int | None, tuple, tuple]]) -> None:
        if not pending:
            return
        summaries = summarize_sharded([item for _, _, item in pending], self.counters)
        for (slot, fields, _), summary in zip(pending, summaries):
            if slot is not None:
                assert summary is not None, "the writer receives every record it writes"
                step, phase, microbatch, name, seq = fields
                self._rows[slot] = (step, phase, microbatch, name, *summary, self.rank, seq)

    def _dump_wanted(self, name: str, step: int) -> bool:
        if not self.dump_names or (self.dump_steps is not None and step not in self.dump_steps):
            return False
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.dump_names)

    def _dump(self, step: int, phase: str, microbatch: int, name: str, tensor: torch.Tensor) -> None:
        if self._dumps is None:
            self._dumps = DumpWriter(self.run_dir)
        self._dumps.write(step, phase, microbatch, name, tensor)

    def _summarize(self, phase: str, tensor: torch.Tensor) -> Summary | Later:
        """The record's Summary (or Later). Inside one forward or backward pass the hooks often
        meet one tensor object twice (a model returning its head's output; one gradient reaching
        a residual branch and the block's output). While the object is alive and its version
        counter unchanged (every in-place op bumps it; autograd's saved-tensor check relies on the
        same counter) its bytes are those just hashed, so the summary is reused. Never reused:
        explicit records (a parameter after an optimizer that writes through `.data`, which bumps
        no counter), an inference tensor (no version counter). DTensors go to _record_shared."""
        with_stats = phase in self.stats_phases
        if phase not in _HOOK_PHASES or type(tensor) not in _PLAIN_TYPES or tensor.is_inference():
            return self._summary_of(tensor, with_stats)
        key = (id(tensor), with_stats)
        seen = self._recent.get(key)
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return seen[2]
        summary = self._summary_of(tensor, with_stats)
        if len(self._recent) >= _RECENT_SUMMARIES:
            del self._recent[next(iter(self._recent))]  # the oldest
        self._recent[key] = (weakref.ref(tensor), tensor._version, summary)
        return summary

    def _summary_of(self, tensor: torch.Tensor, with_stats: bool) -> Summary | Later:
        summary = (summarize_later if summarized_later(tensor) else summarize)(tensor, with_stats=with_stats)
        self.counters.hashed_bytes += tensor.nbytes  # after it: what cannot be hashed counts nothing
        return summary


def _flatten(tree: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Mapping):
            yield from _flatten(value, name + ".")
        elif isinstance(value, (list, tuple)):
            yield from _flatten({str(i): v for i, v in enumerate(value)}, name + ".")
