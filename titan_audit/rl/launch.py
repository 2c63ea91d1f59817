"""Start an RL run on N local ranks through torchrun, or in this process (what `titan-audit rl` runs).

`start_rl(source, out, ...)` resolves the config (a recipe or TOML file with `--set` overrides;
on a resume without a source, the run's own config from its manifest), checks the input and the
run directory before any work (an unknown task, temperature <= 0, a lag larger than the buffer,
a prompt longer than the model's context, a model key that contradicts `--init`: ValueError,
exit 2, nothing written; with `--init` the model section takes the init's shape, see
trainer/init.py), then launches. `nproc=None` runs in this process (under an external torchrun the
ranks join its rendezvous); `nproc=N` runs `python -m torch.distributed.run --standalone
--nproc-per-node N -m titan_audit.rl.rank_entry CONFIG_JSON OUT ...` (rank_entry.py: a module
nothing imports, so runpy never warns that it was imported already) with OMP_NUM_THREADS set from
`parallel.threads` (never from N) and returns its exit code. The launcher is the trainer's
(trainer/launch.py): the run's lock is held for the whole launch, a user error a rank finds comes
back as one line (ValueError), and torchrun and the ranks die with the launcher. On a resume the
checkpoints' small files and the step it would start from are checked before torchrun starts.
Multi-node (`rendezvous`, trainer/launch.py `Rendezvous`): the same rules as `titan-audit train`
(shared filesystem; node 0 claims the run and checks it with W = nnodes * nproc, a node R > 0
checks the request only; a lost node is one line and exit 1).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from titan_audit.rl.config import RECIPES, RLConfig, from_dict, to_dict
from titan_audit.trainer.launch import (
    Rendezvous,
    check_other_node,
    existing_run_locked,
    rank_main,
    resolve_nproc,
    torchrun,
    world_size_of,
)

RANK_ENTRY = "titan_audit.rl.rank_entry"  # what torchrun runs on each rank: `main` below


def resolve_rl_config(
    source: str | None, out: Path, *, resume: bool, overrides: Sequence[str], init: str | None = None
) -> RLConfig:
    """The launch's config; with an --init, its model section takes the init's shape (trainer/init.py)."""
    from titan_audit.trainer.init import resolve_config

    return resolve_config(
        RLConfig, RECIPES, "RL recipe", source, out, kind="rl", resume=resume, overrides=overrides, init=init
    )


def start_rl(
    source: str | None,
    out: Path,
    *,
    init: str | None,
    nproc: int | str | None,
    steps: int | None,
    resume: bool,
    overwrite: bool | str,
    overrides: Sequence[str],
    quiet: bool = False,
    rendezvous: Rendezvous | None = None,
) -> int:
    """Resolve the config, check the request and `out` (rank 0, before any work), run; the exit code."""
    import contextlib

    from titan_audit.rl.loop import check_inputs, check_run

    main_node = rendezvous is None or rendezvous.main_node
    with existing_run_locked(out) if main_node else contextlib.nullcontext():
        if not main_node:
            check_other_node(out, resume=resume)
        config = resolve_rl_config(
            source,
            out,
            resume=resume,
            overrides=[*overrides, *([f"steps={steps}"] if steps is not None else [])],
            init=init,
        )
        nproc = resolve_nproc(nproc, config, rendezvous)
        world_size = world_size_of(nproc, rendezvous)
        if not main_node:
            check_inputs(config, init, world_size)
        elif int(os.environ.get("RANK", "0")) == 0:
            check_run(config, Path(out), init=init, resume=resume, overwrite=overwrite, world_size=world_size)
        return launch_rl(
            config, out, init=init, nproc=nproc, resume=resume, overwrite=overwrite, quiet=quiet, rendezvous=rendezvous
        )


def launch_rl(
    config: RLConfig,
    out: str | os.PathLike,
    *,
    init: str | None = None,
    nproc: int | None = None,
    resume: bool = False,
    overwrite: bool | str = False,
    quiet: bool = False,
    rendezvous: Rendezvous | None = None,
) -> int:
    if nproc is None:
        assert rendezvous is None, "a multi-node launch goes through torchrun"
        from titan_audit.rl.loop import rl_train

        rl_train(config, out, init=init, resume=resume, overwrite=overwrite, quiet=quiet)
        return 0
    flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
    if init is not None:
        flags.append(f"init={os.fspath(init)}")
    threads = config.parallel.threads
    return torchrun(
        RANK_ENTRY,
        to_dict(config),
        out,
        flags,
        nproc=nproc,
        threads=threads,
        resume=resume,
        overwrite=overwrite,
        rendezvous=rendezvous,
    )


def main(argv: list[str] | None = None) -> None:
    """One RL rank under torchrun: `python -m titan_audit.rl.rank_entry CONFIG_JSON OUT [resume]
    [overwrite] [quiet] [init=PATH]` (`launch_rl` writes the resolved config to a JSON file)."""
    from titan_audit.rl.loop import rl_train

    def run(config: dict, out: str, flags: set[str]) -> None:
        init = next((f.split("=", 1)[1] for f in flags if f.startswith("init=")), None)
        resume, overwrite, quiet = "resume" in flags, "overwrite" in flags, "quiet" in flags
        rl_train(from_dict(config), out, init=init, resume=resume, overwrite=overwrite, quiet=quiet)

    rank_main(sys.argv[1:] if argv is None else argv, run)
