"""Where a launch runs: its nodes (`Rendezvous`) and ranks per node (`resolve_nproc`).

Guarantees: the multi-node flags are checked together before anything starts (a ValueError naming
the flag); node 0 hosts torchrun's c10d store and alone does the run directory's work; `--nproc
auto` picks the largest world size the usable cores and the config accept (the trajectory is the
same at every W, so the choice is about speed only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from titan_audit.log import get_logger


@dataclass(frozen=True)
class Rendezvous:
    """Where this launcher's node sits in a multi-node launch: N nodes, this one R, node 0's HOST:PORT."""

    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT of node 0, where the c10d rendezvous store listens

    @classmethod
    def from_options(
        cls, nnodes: int | None, node_rank: int | None, endpoint: str | None, *, nproc: int | None
    ) -> Rendezvous | None:
        """The launch's rendezvous from the CLI's flags (None: one node, `--standalone`);
        ValueError naming the flag for a bad combination."""
        if nnodes is None:
            for flag, value in (("--node-rank", node_rank), ("--rdzv-endpoint", endpoint)):
                if value is not None:
                    raise ValueError(f"{flag} needs --nnodes (the number of nodes)")
            return None
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if endpoint is None:
            raise ValueError("--nnodes needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if nproc is None:
            raise ValueError("--nnodes needs --nproc (the ranks per node)")
        node_rank = 0 if node_rank is None else node_rank
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank} is outside [0, {nnodes}) for --nnodes {nnodes}")
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT with a port in 1..65535")
        return cls(nnodes, node_rank, endpoint)

    @property
    def main_node(self) -> bool:
        """Node 0: the run directory's lock and checks are its launcher's."""
        return self.node_rank == 0

    def torchrun_args(self) -> list[str]:
        is_host = "true" if self.main_node else "false"
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-conf=is_host={is_host}",
        ]


AUTO_NPROC = "auto"


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_nproc(nproc: int | str | None, config, rendezvous: Rendezvous | None = None) -> int | None:  # noqa: ANN001
    """`--nproc` as the launch takes it: N, None (in this process), or for "auto" the largest
    W <= usable cores / parallel.threads that the config accepts (parallel.tp divides it and
    `config.check_world_size(W)` passes), None when that is 1. The trajectory is the same at every
    W (G3), so the choice is about speed only; it is logged. ValueError for N < 1, another
    string, or "auto" with a multi-node launch (give the ranks per node there)."""
    if nproc is None or isinstance(nproc, int):
        if nproc is not None and nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        return nproc
    if nproc != AUTO_NPROC:
        raise ValueError(f"--nproc must be a number >= 1 or {AUTO_NPROC!r}, got {nproc!r}")
    if rendezvous is not None:
        raise ValueError(f"--nproc {AUTO_NPROC} is for one node; with --nnodes give the ranks per node")
    cores, threads = usable_cores(), config.parallel.threads
    for world_size in range(max(cores // threads, 1), 0, -1):
        if world_size % config.parallel.tp:
            continue
        try:
            config.check_world_size(world_size)
        except ValueError:
            continue
        get_logger(__name__).info(
            "--nproc auto: W=%d (%d usable cores, parallel.threads=%d, parallel.tp=%d)",
            world_size,
            cores,
            threads,
            config.parallel.tp,
        )
        return world_size if world_size > 1 else None
    raise ValueError(
        f"--nproc {AUTO_NPROC}: no world size <= {max(cores // threads, 1)} fits the config "
        f"(parallel.tp = {config.parallel.tp}); give --nproc N"
    )


def world_size_of(nproc: int | None, rendezvous: Rendezvous | None) -> int:
    """The launch's W: nnodes * nproc; in-process, torchrun's WORLD_SIZE (else 1)."""
    if nproc is None:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return nproc * (rendezvous.nnodes if rendezvous is not None else 1)
