"""Start a training run on N local ranks through torchrun, or in this process.

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
from pathlib import Path

from titan_audit.trainer.config import TrainConfig, to_dict


def launch(config: TrainConfig, out: str | os.PathLike, *, nproc: int | None, resume: bool = False,
           overwrite: bool = False, stop_at: int | None = None, quiet: bool = False) -> int:  # fmt: skip
    if nproc is None:
        from titan_audit.trainer.train import train

        train(config, out, resume=resume, overwrite=overwrite, stop_at=stop_at, quiet=quiet)
        return 0
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    with tempfile.TemporaryDirectory(prefix="titan-audit-launch-") as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(json.dumps(to_dict(config)))
        flags = [f for f, on in (("resume", resume), ("overwrite", overwrite), ("quiet", quiet)) if on]
        if stop_at is not None:
            flags.append(f"stop_at={stop_at}")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "titan_audit.trainer.train", str(config_file), os.fspath(out), *flags]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(config.parallel.threads)}
        return subprocess.run(command, env=env).returncode
