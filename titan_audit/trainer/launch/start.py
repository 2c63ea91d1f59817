"""Start a job (train or RL, a `JobSpec`) on N ranks through torchrun, or in this process.

Guarantees: `start` resolves the config (trainer/resolve.py) and checks what can be checked
without compute before any rank starts, node 0 (or the only node) under the run's lock: the job's
`check_run` with the launch's W (the request, resume compatibility, overwrite, the checkpoint's
small files, the audit log's tail: what it read there goes to the ranks in the options, so they
do not read it again). A node R > 0 of a multi-node launch checks the request only and leaves the run
directory alone. `launch` runs the job in this process (`nproc=None`: under an external torchrun
its ranks join that rendezvous) or through the supervisor (supervisor.py), and returns the exit code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titan_audit.trainer.launch.rendezvous import Rendezvous, resolve_nproc, world_size_of
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions
from titan_audit.trainer.launch.supervisor import torchrun


def start(
    job: JobSpec,
    source: str | None,
    out: str | os.PathLike,
    *,
    nproc: int | str | None,
    options: LaunchOptions,
    steps: int | None = None,
    overrides: Sequence[str] = (),
    rendezvous: Rendezvous | None = None,
) -> int:
    """Resolve the config (`source` with `overrides`, `steps` overriding its step count), check
    the request and `out` (see the module docstring), launch; the exit code. `nproc`: N ranks,
    None (this process) or "auto" (`resolve_nproc`)."""
    from titan_audit.trainer.resolve import resolve_config

    job.check_options(options)
    out = Path(out)
    main_node = rendezvous is None or rendezvous.main_node
    with existing_run_locked(out) if main_node else contextlib.nullcontext():
        if not main_node:
            check_other_node(out, resume=options.resume)
        overrides = [*overrides, *([f"steps={steps}"] if steps is not None else [])]
        config = resolve_config(job, source, out, resume=options.resume, overrides=overrides, init=options.init)
        nproc = resolve_nproc(nproc, config, rendezvous)
        world_size = world_size_of(nproc, rendezvous)
        if not main_node:
            job.check_request(config, world_size, options)
        elif int(os.environ.get("RANK", "0")) == 0:  # what it verified of the audit log goes to the ranks
            verified = job.check_run(config, out, world_size, options).audit_verified
            options = dataclasses.replace(options, audit_verified=verified or None)
        return launch(job, config, out, nproc=nproc, options=options, rendezvous=rendezvous)


def launch(
    job: JobSpec,
    config: Any,
    out: str | os.PathLike,
    *,
    nproc: int | None,
    options: LaunchOptions = LaunchOptions(),  # noqa: B008 (frozen: shared safely)
    rendezvous: Rendezvous | None = None,
) -> int:
    """Run `job` with a resolved `config` into `out`: in this process (`nproc=None`) or on `nproc`
    ranks per node through torchrun; the exit code (0 ok; a user error raises a ValueError)."""
    if nproc is None:
        assert rendezvous is None, "a multi-node launch goes through torchrun"
        job.run(config, out, options)
        return 0
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return torchrun(job, config, out, options, nproc=nproc, rendezvous=rendezvous)


def check_other_node(out: str | os.PathLike, *, resume: bool) -> None:
    """What a node R > 0 checks of the run directory (it claims nothing): a resume needs a run."""
    from titan_audit.trainer.run_dir import MANIFEST, is_run_dir

    if resume and not is_run_dir(Path(out)):
        raise ValueError(f"{out}: no run to resume ({MANIFEST} not found; the run directory must be shared)")


@contextlib.contextmanager
def existing_run_locked(out: str | os.PathLike):
    """Hold the lock of `out` while checking it, when it exists (rank 0 / the launcher only):
    a run another live process writes is refused before anything reads it."""
    from titan_audit.audit.run_lock import lock_existing_run, release

    out = Path(out)
    if int(os.environ.get("RANK", "0")) != 0 or not lock_existing_run(out):
        yield
        return
    try:
        yield
    finally:
        release(out)
