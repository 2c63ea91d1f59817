"""Where a rank sits: the process group and the (dp, tp) mesh of the configured device.

Guarantees: `init_mesh` joins the group torchrun describes (or makes a one-rank group where FSDP2
or tensor parallelism needs one) with the backend `parallel.backend` names ("auto": nccl on cuda,
gloo on cpu, by the configured device alone); on cuda a rank takes GPU LOCAL_RANK or fails naming
`parallel.device`. `broadcast_error` makes rank 0's verdict every rank's, before any work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    """Where this process sits: data parallel (dp ranks) x tensor parallel (tp ranks), W = dp * tp,
    global rank = dp_rank * tp + tp_rank (torch's row-major DeviceMesh). TP ranks of one dp rank
    read the same microbatches; the loader and the gradient tree run over the dp group.
    Recorded in the manifest's history, like the world size: never part of the numerics."""

    device_type: str  # "cpu" | "cuda": parallel.device
    world_size: int
    rank: int
    tp: int = 1
    device_mesh: Any = None  # the (dp, tp) DeviceMesh when tp > 1
    device_index: int | None = None  # on cuda: this rank's GPU (LOCAL_RANK)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: the CPU, or its own GPU (explicit index, valid in any thread)."""
        return torch.device(self.device_type, self.device_index)

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's dp peers (None: the default group, at tp = 1)."""
        return None if self.device_mesh is None else self.device_mesh.get_group("dp")

    @property
    def tp_mesh(self) -> Any:
        return None if self.device_mesh is None else self.device_mesh["tp"]

    @property
    def dp_mesh(self) -> Any:
        """The dp dimension of the (dp, tp) mesh (None at tp = 1)."""
        return None if self.device_mesh is None else self.device_mesh["dp"]

    def fsdp_mesh(self) -> Any:
        """The mesh FSDP2 shards over: the dp dimension of the (dp, tp) mesh, or at tp = 1 a 1-D
        mesh of every rank on this run's device (FSDP2's own default mesh would be CUDA whenever a
        GPU is visible, whatever the config says). Needs the process group."""
        if self.device_mesh is not None:
            return self.device_mesh["dp"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))

    def describe(self) -> str:
        """The progress lines' layout: W=4, or with tensor parallelism W=4 (dp 2 x tp 2)."""
        return f"W={self.world_size}" + (f" (dp {self.dp} x tp {self.tp})" if self.tp > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "dp": self.dp, "tp": self.tp}


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def resolve_backend(backend: str, device: str) -> str:
    """The process-group backend of `parallel.backend` on `parallel.device`: "auto" is nccl on
    cuda and gloo on cpu (by the configured device alone, never by what this machine has)."""
    assert device in ("cpu", "cuda"), device
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return backend


def init_mesh(backend: str = "auto", *, device: str = "cpu", single_group: bool = False, tp: int = 1) -> Mesh:
    """Join the process group torchrun describes in the environment (if any and not joined yet),
    on `device` ("cpu" | "cuda": on cuda this rank first takes GPU LOCAL_RANK, a ValueError naming
    parallel.device when the node has fewer GPUs). `single_group`: without one, make a one-rank
    group (FSDP2 needs a group even at W=1). tp > 1: the (dp, tp) DeviceMesh of `device` over the
    group (the caller checked that tp divides W)."""
    backend = resolve_backend(backend, device)
    index = None
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= visible:
            raise ValueError(
                f"parallel.device = 'cuda': local rank {index} needs GPU {index} and this node has {visible} "
                f"visible; run at most {visible} rank(s) per node"
            )
        torch.cuda.set_device(index)
    if not dist.is_initialized():  # no device_id: NCCL starts lazily, after deterministic.enable pinned its order
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            dist.init_process_group(backend)
        elif single_group or tp > 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized():
        return Mesh(device, 1, 0, device_index=index)
    world_size = dist.get_world_size()
    device_mesh = None
    if tp > 1 and world_size % tp == 0:
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return Mesh(device, world_size, dist.get_rank(), tp if device_mesh is not None else 1, device_mesh, index)


def broadcast_error(message: str | None) -> None:
    """Rank 0's verdict reaches every rank, so all fail (or go on) together, before any work."""
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise ValueError(message)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
