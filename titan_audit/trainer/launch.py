"""Start a training run on N local ranks through torchrun, or in this process.

`start_run(source, out, ...)` is what `titan-audit train` runs: it resolves the config (a recipe
or TOML file with `--set` overrides; on a resume without a source, the run's own config from its
manifest), checks the run directory before any work (rank 0), then launches.

`launch(config, out, nproc=N, ...)` writes the resolved config to a temporary JSON file and runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m titan_audit.trainer.train ...`
as a subprocess; it returns torchrun's exit code (0 ok, 2 bad input found by rank 0). The ranks'
intra-op thread count comes from `parallel.threads` (exported as OMP_NUM_THREADS too, so torchrun
does not pick one): never from N. `nproc=None` runs in this process: under an external torchrun
the ranks join the rendezvous that torchrun put in the environment; otherwise a single process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from titan_audit.trainer.config import TrainConfig, from_dict, load_config, to_dict


def resolve_config(source: str | None, out: Path, *, resume: bool, overrides: Sequence[str]) -> TrainConfig:
    """`source` (a recipe name or a TOML file) with `overrides` (KEY=VALUE); with no source on a
    resume, the config saved in `out`'s manifest with the overrides applied."""
    from titan_audit.trainer.run_dir import read_manifest
    from titan_audit.trainer.typed_config import apply_overrides

    if source is not None:
        return load_config(source, list(overrides))
    if not resume:
        raise ValueError("--config is required (a recipe name or a TOML file) unless --resume")
    return from_dict(apply_overrides(read_manifest(out)["config"], list(overrides)), f"{out}/manifest.json config")


def start_run(source: str | None, out: Path, *, nproc: int | None, steps: int | None, resume: bool,
              overwrite: bool, overrides: Sequence[str]) -> int:  # fmt: skip
    """Resolve the config, check `out` (rank 0, before any work), train; torchrun's exit code."""
    from titan_audit.trainer.train import check_run_dir

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    config = resolve_config(source, out, resume=resume,
                            overrides=[*overrides, *([f"steps={steps}"] if steps is not None else [])])  # fmt: skip
    world_size = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        check_run_dir(config, out, resume=resume, overwrite=overwrite, world_size=world_size)
    return launch(config, out, nproc=nproc, resume=resume, overwrite=overwrite)


def launch(config: TrainConfig, out: str | os.PathLike, *, nproc: int | None, resume: bool = False,
           overwrite: bool = False, stop_at: int | None = None, quiet: bool = False) -> int:  # fmt: skip
    if nproc is None:
        from titan_audit.trainer.train import train

        train(config, out, resume=resume, overwrite=overwrite, stop_at=stop_at, quiet=quiet)
        return 0
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
    if stop_at is not None:
        flags.append(f"stop_at={stop_at}")
    return torchrun("titan_audit.trainer.train", to_dict(config), out, flags, nproc=nproc, threads=config.parallel.threads)


def torchrun(module: str, config: dict, out: str | os.PathLike, flags: Sequence[str], *, nproc: int, threads: int) -> int:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE CONFIG_JSON OUT
    FLAGS...` with the resolved config in a temporary JSON file and OMP_NUM_THREADS = `threads`;
    torchrun's exit code. MODULE's `main` reads those arguments (see `rank_main`)."""
    with tempfile.TemporaryDirectory(prefix="titan-audit-launch-") as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(config))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", module, str(config_file), os.fspath(out), *flags]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        return subprocess.run(command, env=env).returncode


def rank_main(argv: Sequence[str], run: Callable[[dict, str, set[str]], object]) -> None:
    """One rank's entry point under `torchrun`: run(config dict, out, flags) from
    `CONFIG_JSON OUT FLAGS...`; a ValueError is printed once (rank 0) and exits 2; the process
    group is destroyed either way."""
    import torch.distributed as dist

    config = json.loads(Path(argv[0]).read_text())
    try:
        run(config, argv[1], set(argv[2:]))
    except ValueError as error:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(f"Error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
