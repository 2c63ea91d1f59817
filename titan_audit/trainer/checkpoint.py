"""Checkpoints that are atomic, verified on load, and reshardable across world sizes.

Guarantees:
- Atomic at the directory level. A save writes `checkpoints/.step_NNNNNNNN.partial/` and renames it
  to `checkpoints/step_NNNNNNNN/` only after every file is written and synced; `hashes.json` is the
  last file written. A crash at any moment leaves the previous good checkpoint visible and intact.
- Verified, by the rank that wrote or read each piece. `hashes.json` (format 3) holds, for every
  model and optimizer tensor, its fingerprint (audit.fingerprint: the same string as its audit
  record at any layout), its dtype and shape, and its pieces as the ranks held them at the save:
  index runs, lattice lanes and holders (audit/by_piece.py). After the save each rank hashes only
  its own share of what it wrote; after `dcp.load` each rank hashes its share of what it read,
  against every recorded piece it overlaps, and the ranks of each mesh add up 16 bytes per piece
  (lanes add up over any partition): so a checkpoint written at W = 4 under FSDP2 verifies at W
  = 2, no tensor is gathered but those of at most C bytes to rank 0 at the save, and a flipped
  byte is reported with its piece, its writers and the ranks that read it. Format 2 (the same
  with lattice lanes of version 1) still loads and verifies with that version's lanes, and format
  1 (every tensor's whole xxh3) still loads and verifies, gathering DTensors. `load`
  refuses a checkpoint whose bytes differ, which catches flipped bytes and truncated files;
  `load_latest(fallback=True)` then falls back to the newest older checkpoint that verifies,
  says so on stderr (rank 0) and moves the corrupt ones aside to `corrupt-step_NNNNNNNN` (kept,
  never deleted; the resumed run writes its own `step_NNNNNNNN` again). With checkpoints
  present but none that verifies it raises: a resume never silently restarts from step 0. Every
  error names the checkpoint in one line (DCP's own errors carry the failed ranks' tracebacks in
  their text: `dcp_reason` keeps the first exception's type and first line; the traceback is
  logged at DEBUG, -v).
- A save that fails (a full disk, a read-only run directory) removes its partial directory and
  raises an OSError naming the checkpoint and the errno: ENOSPC for a full device, whose symptom
  in DCP's writer is a RuntimeError 'unexpected pos'.
- Checked before any rank starts. `preflight(fallback)` reads only the small files (trainer.json,
  hashes.json, DCP .metadata present) and names the step a resume would start from, or raises
  the error the ranks would raise, so the launcher reports it before torchrun.
- Reshardable. Model and optimizer go through torch.distributed.checkpoint (DCP) with FQN state
  dicts from `get_state_dict`, so a checkpoint written at W ranks loads at any other W, for
  replicated parameters and for FSDP2 DTensors alike.
- Rank-agnostic trainer state (step, data-loader state, config, ...) is one JSON blob written by
  rank 0, the same for every W.

Layout of one checkpoint:
    step_NNNNNNNN/model_optim/    DCP files
    step_NNNNNNNN/trainer.json    rank-agnostic state (JSON)
    step_NNNNNNNN/hashes.json     {"format": 3, "step": N, "whole_hash_bytes": C,
                                   "tensors": {name: fingerprint}, "meta": {name: "float32[4, 8]"},
                                   "pieces": {name: [{"index", "lanes", "ranks"}]}, "param_groups": [...]}
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from titan_audit import faults
from titan_audit.atomic import write_json_atomic
from titan_audit.audit.by_piece import digests_by_piece, verify_by_piece
from titan_audit.audit.fingerprint import whole_digest, whole_hash_bytes, whole_hash_limit
from titan_audit.batch_invariant.cpu import lattice
from titan_audit.log import get_logger
from titan_audit.trainer.crash import crash_point

log = get_logger(__name__)

FORMAT_VERSION = 1  # trainer.json
HASHES_FORMAT = 3  # hashes.json: 3 digests by piece (lattice v2); 2 (lattice v1) and 1 (whole xxh3) still load
_LATTICE_BY_FORMAT = {2: 1, 3: 2}  # the lattice version of each by-piece format
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CorruptCheckpointError(ValueError):
    """A checkpoint directory exists but its contents do not verify."""


_FULL_DISK_BYTES = 1 << 20  # less free than this after a failed save: the disk was full


def dcp_reason(error: BaseException) -> str:
    """One line for an error of torch.distributed.checkpoint: its CheckpointException carries each
    failed rank's exception with a traceback in its text; this is the first rank's exception,
    its type and first line (the traceback goes to the -v log)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(sorted(error.failures.items())))
        more = len(error.failures) - 1
        return f"rank {rank}: {dcp_reason(cause)}" + (f" (and {more} more rank(s))" if more else "")
    line = faults.error_line(error)
    if (isinstance(error, OSError) and error.errno is not None) or line == type(error).__name__:
        return line
    return f"{type(error).__name__}: {line}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process save/load and logs errors we re-raise with context."""
    dcp_logger = logging.getLogger("c10d-NullHandler-dcp_logger")
    previous = dcp_logger.disabled
    dcp_logger.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        dcp_logger.disabled = previous


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _named_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[list[tuple[str, torch.Tensor]], list[dict]]:
    """Every model/optimizer tensor by FQN (`model.<fqn>`, `optim.<fqn>.<key>`, sorted), plus the
    optimizer's scalar groups (optimizer None: the model's tensors only, no groups)."""
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model), {"state": {}, "param_groups": []}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    named = {f"model.{name}": t for name, t in model_sd.items() if isinstance(t, torch.Tensor)}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                named[f"optim.{fqn}.{key}"] = value
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optim_sd["param_groups"]]
    return sorted(named.items()), json.loads(json.dumps(groups, default=str))


def _whole_hashes(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """hashes.json format 1's digests: xxh3-128 of every full tensor (a DTensor is gathered:
    collective, every rank calls it). Only to check checkpoints written in that format."""
    return {name: whole_digest(t) for name, t in named}


class Checkpointer:
    """Saves and loads checkpoints under `run_dir/checkpoints`, keeping the last `keep_last`."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete (renamed) checkpoints, ascending. Verification happens on load."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]
    ) -> Path:
        """Write checkpoint `step` (collective: every rank calls it). Returns its directory."""
        final = self.path(step)
        partial = self.root / f".{final.name}.partial"
        if final.exists():
            raise ValueError(f"{final} already exists; refusing to overwrite a checkpoint")
        if _rank() == 0:
            if partial.exists():
                log.info("removing %s left by an interrupted save", partial)
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        _barrier()
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            with _quiet_dcp():
                dcp.save(
                    {"model": model_sd, "optim": optim_sd},
                    checkpoint_id=partial / "model_optim",
                    no_dist=not _distributed(),
                )
            named, groups = _named_tensors(model, optimizer)
            record = digests_by_piece(named)  # collective: each rank hashes the piece it wrote
            if _rank() == 0:
                write_json_atomic(partial / "trainer.json", {"format": FORMAT_VERSION, "step": step, **trainer_state})
                hashes = {"format": HASHES_FORMAT, "step": step, "whole_hash_bytes": whole_hash_bytes(), **record}
                write_json_atomic(partial / "hashes.json", {**hashes, "param_groups": groups})
                _fsync_tree(partial)
                crash_point("checkpoint.before_rename", step, partial)
                os.replace(partial, final)
        except (Exception, CheckpointException) as error:  # a full disk, a read-only run, DCP's own errors
            raise self._save_failed(error, final, partial) from error
        if _rank() == 0:
            self._retain()
        _barrier()
        return final

    @staticmethod
    def _save_failed(error: BaseException, final: Path, partial: Path) -> OSError:
        """The error a failed save raises: an OSError naming the checkpoint, its errno when the
        cause says it (or the device is full: DCP's writer reports ENOSPC as 'unexpected pos'),
        after its partial directory is removed (rank 0), so nothing half-written stays."""
        free = shutil.disk_usage(final.parent).free if final.parent.is_dir() else None
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, OSError) and error.errno is not None:
            return OSError(error.errno, error.strerror, error.filename or str(final))
        if free is not None and free < _FULL_DISK_BYTES:
            return OSError(errno.ENOSPC, "no space left on device", str(final))
        return OSError(f"{final}: the checkpoint could not be written ({dcp_reason(error)})")

    def _retain(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            log.info("checkpoint retention (keep_last=%d): removing %s", self.keep_last, self.path(step))
            shutil.rmtree(self.path(step))

    def load(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Load checkpoint `step` into model and optimizer, verify every tensor, return trainer state.
        optimizer None: the model's tensors only, read and verified (no optimizer is built)."""
        path = self.path(step)
        trainer_state = self._check_small_files(step)
        expected = self._read_json(path / "hashes.json")
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            expected["tensors"] = {k: v for k, v in expected["tensors"].items() if k.startswith("model.")}
            expected["param_groups"] = []
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        try:
            with _quiet_dcp():
                dcp.load(state, checkpoint_id=path / "model_optim", no_dist=not _distributed())
        except (Exception, CheckpointException) as error:  # DCP's error types vary; name the checkpoint
            log.debug("reading %s failed", path, exc_info=error)
            reason = dcp_reason(error)
            raise CorruptCheckpointError(f"{path}: cannot read model/optimizer tensors ({reason})") from error
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        named, groups = _named_tensors(model, optimizer)
        if expected.get("format", 1) >= 2:  # each rank checks the pieces it read
            limit = int(expected.get("whole_hash_bytes", whole_hash_bytes()))
            with whole_hash_limit(limit), lattice.using_version(_LATTICE_BY_FORMAT[expected["format"]]):
                differing = verify_by_piece(named, expected, str(path / "hashes.json"))
        else:
            actual = _whole_hashes(named)
            differing = sorted(
                name
                for name in expected["tensors"].keys() | actual.keys()
                if expected["tensors"].get(name) != actual.get(name)
            )
        if differing:  # one line per problem, each starting with its tensor's name
            tensors = len({line.split(": ", 1)[0] for line in differing})
            raise CorruptCheckpointError(f"{path}: {tensors} tensor(s) do not match hashes.json, first {differing[0]}")
        if groups != expected["param_groups"]:
            raise CorruptCheckpointError(f"{path}: optimizer param_groups do not match hashes.json")
        return trainer_state

    def _check_small_files(self, step: int) -> dict[str, Any]:
        """The checks that need no tensors: files present, JSON valid, formats, step; trainer state."""
        path = self.path(step)
        hashes_file, trainer_file = path / "hashes.json", path / "trainer.json"
        if not path.is_dir():
            raise ValueError(f"{path}: no such checkpoint")
        for required in (trainer_file, hashes_file, path / "model_optim" / ".metadata"):
            if not required.is_file():
                raise CorruptCheckpointError(f"{required}: missing; the checkpoint is incomplete")
        expected = self._read_json(hashes_file)
        trainer_state = self._read_json(trainer_file)
        if expected.get("format", 0) > HASHES_FORMAT or trainer_state.get("format", 0) > FORMAT_VERSION:
            raise ValueError(
                f"{path}: written by a newer titan-audit (hashes.json format > {HASHES_FORMAT} or "
                f"trainer.json format > {FORMAT_VERSION})"
            )
        if not isinstance(expected.get("tensors"), dict) or "param_groups" not in expected:
            raise CorruptCheckpointError(f"{hashes_file}: keys 'tensors' and 'param_groups' missing")
        if trainer_state.get("step") != step:
            raise CorruptCheckpointError(
                f"{trainer_file}: key 'step' is {trainer_state.get('step')!r}, expected {step}"
            )
        return trainer_state

    def preflight(self, *, fallback: bool) -> tuple[int, list[str]]:
        """(step a resume starts from, corrupt checkpoints it would skip), from the small files only;
        0 when there is no checkpoint. Raises like `load_latest` where the small files decide."""
        skipped: list[str] = []
        for step in reversed(self.steps()):
            try:
                self._check_small_files(step)
            except CorruptCheckpointError as error:
                if not fallback:
                    raise self._no_fallback(error, step) from None
                skipped.append(str(error))
                continue
            return step, skipped
        if skipped:
            raise CorruptCheckpointError(f"{skipped[0]}; no older valid checkpoint to resume from")
        return 0, []

    def _no_fallback(self, error: CorruptCheckpointError, step: int) -> CorruptCheckpointError:
        older = [s for s in self.steps() if s < step]
        if not older:
            return CorruptCheckpointError(f"{error}; no older checkpoint to resume from")
        return CorruptCheckpointError(
            f"{error}; checkpoint.fallback=true (the default) resumes from the older {self.path(older[-1]).name}"
        )

    def load_latest(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, fallback: bool = False
    ) -> dict[str, Any] | None:
        """Load the newest checkpoint; with `fallback`, the newest that verifies (the corrupt newer
        ones are reported and moved aside, see the module docstring). None if there is none."""
        skipped: list[tuple[int, CorruptCheckpointError]] = []
        for step in reversed(self.steps()):
            try:
                state = self.load(step, model, optimizer)
            except CorruptCheckpointError as error:
                if not fallback:
                    raise self._no_fallback(error, step) from None
                skipped.append((step, error))
                continue
            self._set_aside(skipped, step)
            return state
        if skipped:
            raise CorruptCheckpointError(f"{skipped[0][1]}; no older valid checkpoint to resume from")
        return None

    def _set_aside(self, skipped: list[tuple[int, CorruptCheckpointError]], used: int) -> None:
        if not skipped:
            return
        _barrier()  # every rank has read what it needed from the corrupt ones
        if _rank() == 0:
            for step, error in skipped:
                final = self.path(step)
                aside = final.with_name(f"corrupt-{final.name}")  # not step_*: no reader takes it for a checkpoint
                n = 1
                while aside.exists():
                    n += 1
                    aside = final.with_name(f"corrupt-{final.name}.{n}")
                os.replace(final, aside)
                log.warning(
                    "%s; resuming from %s (the corrupt checkpoint is kept as %s)",
                    error,
                    self.path(used).name,
                    aside.name,
                )
        _barrier()

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CorruptCheckpointError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{path}: expected a JSON object")
        return data
