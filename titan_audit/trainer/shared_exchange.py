"""A same-host transport for the tree reduction: one shared-memory file that every rank maps.

Guarantee: it moves bytes only. A rank writes its partial sums into its slots, a barrier makes them
visible, every rank reads the others' slots where they lie, and the reduced chunks are gathered
through one shared vector the same way; the additions are the reducer's (trainer/reduce.py), so
every result has the bits the gloo path gives (tests/trainer/test_reduce.py).

Why: with every rank on one machine, gloo still sends the chunks through TCP on the loopback (a
10 MB gradient at W = 2: ~14 ms a step on a 2-core VM, more than the optimizer step), where a
shared mapping costs two copies at memory speed and two barriers.

When: CPU tensors, a gloo group whose ranks all report this host (hostname and kernel boot id),
and a file in SHM_DIR (tmpfs) whose pages `posix_fallocate` could reserve on rank 0, which every
rank finds with rank 0's random nonce in it and maps (`torch.from_file(..., shared=True)`). Any
rank that cannot makes every rank fall back to gloo, decided together (the opening is a collective
of the group), and the reducer stays on gloo from then on. The file is unlinked as soon as every
rank maps it, so nothing is left behind once the ranks exit; only a crash between its creation
and that moment leaves a `titan-audit-reduce-*` file in SHM_DIR.
`TITAN_AUDIT_SHARED_EXCHANGE=0` turns the transport off (every reduce goes over gloo).

Layout (elements of the gradient dtype): W * slots_per_rank slots of `capacity` elements, then
the gathered vector. Slot (r, i) holds rank r's i-th partial at its own offsets (only the chunks of
other ranks are written). Any vector of up to `capacity` elements uses the same region, so
reductions of several sizes (the tensor-parallel partials) do not open one each. The barriers that
keep a step's writes from overtaking another rank's reads are the reducer's to place (see
TreeReducer._reduce).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
ENV_SWITCH = "TITAN_AUDIT_SHARED_EXCHANGE"
FILE_PREFIX = "titan-audit-reduce-"


def _host_identity() -> str:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "?"
    return f"{socket.gethostname()}/{boot_id}"


class SharedExchange:
    """The mapped region of one (capacity, dtype, slots_per_rank) shape; see the module doc."""

    def __init__(self, region: torch.Tensor, capacity: int, world_size: int, slots_per_rank: int) -> None:
        self.capacity, self.world_size, self.slots_per_rank = capacity, world_size, slots_per_rank
        self._region = region

    def fits(self, numel: int, dtype: torch.dtype, slots_per_rank: int) -> bool:
        """Whether reductions of this shape can use this region."""
        return numel <= self.capacity and dtype == self._region.dtype and slots_per_rank <= self.slots_per_rank

    def slot(self, rank: int, index: int, numel: int) -> torch.Tensor:
        """The first `numel` elements of rank `rank`'s `index`-th partial slot (shared)."""
        assert 0 <= rank < self.world_size and 0 <= index < self.slots_per_rank and numel <= self.capacity
        offset = (rank * self.slots_per_rank + index) * self.capacity
        return self._region[offset : offset + numel]

    def gathered(self, numel: int) -> torch.Tensor:
        """The first `numel` elements of the vector the reduced chunks are gathered in (shared)."""
        assert numel <= self.capacity
        offset = self.world_size * self.slots_per_rank * self.capacity
        return self._region[offset : offset + numel]

    @classmethod
    def open(
        cls, capacity: int, dtype: torch.dtype, slots_per_rank: int, group: dist.ProcessGroup | None
    ) -> SharedExchange | None:
        """Map a region on every rank of `group`, or None on every rank (gloo then). Collective."""
        if dist.get_backend(group) != dist.Backend.GLOO:
            return None  # the group's backend: the same answer on every rank
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        # The switch is gathered with the host: ranks launched with different environments must
        # still decide together (one rank skipping the collectives below would hang the others).
        hosts: list[tuple[str, bool] | None] = [None] * world_size
        dist.all_gather_object(hosts, (_host_identity(), os.environ.get(ENV_SWITCH, "1") != "0"), group=group)
        if len({host for host, _ in hosts}) != 1 or not all(enabled for _, enabled in hosts):
            return None
        elements = (world_size * slots_per_rank + 1) * capacity
        nbytes = elements * dtype.itemsize
        created = _create(nbytes) if rank == 0 else None
        box = [created]
        dist.broadcast_object_list(box, group=group, group_src=0)
        path, nonce = box[0] if box[0] is not None else (None, None)
        region = None
        if path is not None and (rank == 0 or _holds(path, nonce)):
            try:
                region = torch.from_file(path, shared=True, size=elements, dtype=dtype)
            except (OSError, RuntimeError):
                region = None
        mapped = torch.tensor([int(region is not None)], dtype=torch.int64)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)
        if rank == 0 and path is not None:
            os.unlink(path)  # every rank has mapped it, or none will use it
        if not mapped.item():
            return None
        assert region is not None
        return cls(region, capacity, world_size, slots_per_rank)


def _create(nbytes: int) -> tuple[str, bytes] | None:
    """A new file of `nbytes` in SHM_DIR with its pages reserved (a full tmpfs fails here, cleanly,
    instead of killing a rank with SIGBUS at its first write) and a random nonce in its first
    bytes; (path, nonce), or None when that cannot be done."""
    path = os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    nonce = secrets.token_bytes(16)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, max(nbytes, len(nonce)))
        os.pwrite(fd, nonce, 0)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path, nonce


def _holds(path: str, nonce: bytes) -> bool:
    """Whether `path` is rank 0's file: it exists here (never created by this rank: `from_file`
    would make an empty one) and starts with rank 0's nonce. Two hosts that report one identity
    (containers with one hostname, each its own /dev/shm) fail here instead of reading zeros."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.pread(fd, len(nonce), 0) == nonce
    finally:
        os.close(fd)
