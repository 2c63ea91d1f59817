"""Multi-rank test helper: `run_ranks(fn, world_size, args)` runs fn on W gloo processes.

`titan_audit.trainer.local_ranks.run_local_ranks` (see there), with one difference in how a rank
process starts: it is forked from a forkserver that imported torch and titan_audit once (per test
process), instead of a spawned interpreter importing them again (~3-4 s of CPU per rank, the
suite starts a few hundred ranks). Each rank is still its own fresh process: the server runs no
test code, the rank imports fn's module itself, gets this process's sys.path, working directory
and environment as a spawned rank does, writes to this process's stdout/stderr (pytest's capture)
and runs the same `_entry` (its own gloo group, result file, exit).

The server reads the environment once, when it starts (torch, MKL and the kernel library read
some variables as they load). A call made while the environment differs from the server's (a
test set a variable for its ranks; an in-process run set CUBLAS_WORKSPACE_CONFIG, the memory
policy's variable, ...) first replaces the server with one started in the environment of now,
so a rank always loads what a spawned rank would load. The bench suites' tests put `run_ranks`
in the place of the suites' `run_local_ranks` (those ranks are timed; no test asserts a time).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from titan_audit.trainer import local_ranks
from titan_audit.trainer.local_ranks import run_local_ranks as spawn_ranks

# What the server imports before it forks: what the rank functions' modules import, mostly.
PRELOAD = ["pytest", "titan_audit.trainer.train", "titan_audit.trainer.replay", "titan_audit.live_bytes"]
# Set by pytest per test phase and read by nothing a rank imports; a rank gets this process's value.
PER_TEST = ("PYTEST_CURRENT_TEST",)
_server_env: dict[str, str] | None = None


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PER_TEST}


def _forked_entry(rank: int, env: dict[str, str], parent: int, *entry_args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd in (1, 2):  # the parent's stdout/stderr now (pytest's capture), as a spawned rank's
        try:
            target = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)
    local_ranks._entry(rank, *entry_args)


def _server_in_this_environment() -> None:
    """The forkserver started in the environment of now (one started in another is stopped)."""
    global _server_env
    env = _environment()
    if env == _server_env:
        return
    if _server_env is not None:
        multiprocessing.forkserver._forkserver._stop()  # no rank of it is alive: each call joins its ranks
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    _server_env = env


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), threads: int = 1) -> list[Any]:
    if world_size < 1:
        return spawn_ranks(fn, world_size, args, threads)  # its ValueError
    _server_in_this_environment()
    with tempfile.TemporaryDirectory(prefix="titan-audit-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        entry_args = (dict(os.environ), os.getpid(), fn, world_size, store, tmp, args, threads)
        mp.start_processes(_forked_entry, args=entry_args, nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


__all__ = ["run_ranks"]
