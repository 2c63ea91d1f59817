"""Start an RL run on N local ranks through torchrun, or in this process (what `titan-audit rl` runs).

`start_rl(source, out, ...)` resolves the config (a recipe or TOML file with `--set` overrides;
on a resume without a source, the run's own config from its manifest), checks the input and the
run directory before any work (an unknown task, temperature <= 0, a lag larger than the buffer,
a prompt longer than the model's context, `--init` of another shape: ValueError, exit 2, nothing
written), then launches. `nproc=None` runs in this process (under an external torchrun the
ranks join its rendezvous); `nproc=N` runs `python -m torch.distributed.run --standalone
--nproc-per-node N -m titan_audit.rl.loop CONFIG_JSON OUT ...` with OMP_NUM_THREADS set from
`parallel.threads` (never from N) and returns its exit code. The launcher is the trainer's
(trainer/launch.py): the run's lock is held for the whole launch, a user error a rank finds comes
back as one line (ValueError), and torchrun and the ranks die with the launcher. On a resume the
checkpoints' small files and the step it would start from are checked before torchrun starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from titan_audit.rl.config import RLConfig, from_dict, load_rl_config, to_dict
from titan_audit.trainer.launch import existing_run_locked, torchrun


def resolve_rl_config(source: str | None, out: Path, *, resume: bool, overrides: Sequence[str]) -> RLConfig:
    from titan_audit.trainer.run_dir import read_manifest
    from titan_audit.trainer.typed_config import apply_overrides

    if source is not None:
        return load_rl_config(source, list(overrides))
    if not resume:
        raise ValueError("--config is required (an RL recipe name or a TOML file) unless --resume")
    try:
        return from_dict(apply_overrides(read_manifest(out)["config"], list(overrides)))
    except ValueError as error:
        raise ValueError(f"{out}/manifest.json config: {error}") from None


def start_rl(
    source: str | None,
    out: Path,
    *,
    init: str | None,
    nproc: int | None,
    steps: int | None,
    resume: bool,
    overwrite: bool,
    overrides: Sequence[str],
    quiet: bool = False,
) -> int:
    from titan_audit.rl.loop import check_run_dir
    from titan_audit.trainer.checkpoint import Checkpointer

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    with existing_run_locked(out):
        config = resolve_rl_config(
            source, out, resume=resume, overrides=[*overrides, *([f"steps={steps}"] if steps is not None else [])]
        )
        world_size = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if int(os.environ.get("RANK", "0")) == 0:
            check_run_dir(config, Path(out), init=init, resume=resume, overwrite=overwrite, world_size=world_size)
            if resume:
                start, _ = Checkpointer(out).preflight(fallback=config.checkpoint.fallback)
                if start >= config.steps:
                    raise ValueError(
                        f"{out}: already at step {start} of steps={config.steps}; nothing to run "
                        f"(--steps N or --set steps=N with N > {start} extends it)"
                    )
        if nproc is None and int(os.environ.get("RANK", "0")) == 0:  # in this process: hold the lock here
            from titan_audit.trainer.run_dir import run_lock

            with run_lock(out, resume=resume, overwrite=overwrite):
                return launch_rl(config, out, init=init, nproc=None, resume=resume, overwrite=overwrite, quiet=quiet)
        return launch_rl(config, out, init=init, nproc=nproc, resume=resume, overwrite=overwrite, quiet=quiet)


def launch_rl(
    config: RLConfig,
    out: str | os.PathLike,
    *,
    init: str | None = None,
    nproc: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
) -> int:
    if nproc is None:
        from titan_audit.rl.loop import rl_train

        rl_train(config, out, init=init, resume=resume, overwrite=overwrite, quiet=quiet)
        return 0
    flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
    if init is not None:
        flags.append(f"init={os.fspath(init)}")
    return torchrun(
        "titan_audit.rl.loop",
        to_dict(config),
        out,
        flags,
        nproc=nproc,
        threads=config.parallel.threads,
        resume=resume,
        overwrite=overwrite,
    )
