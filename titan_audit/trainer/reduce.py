"""Deterministic gradient reduction: one fixed binary tree over the V virtual microbatches.

Guarantee (G3): the reduced gradient has the same bits for every world size W that divides V.

Why it holds. Floating-point addition is not associative, so the bits of a sum depend on the
order of the additions. Here the order is a tree that depends on V alone:

    node [lo, hi) with n = hi - lo > 1 splits at lo + 2**(ceil(log2 n) - 1)
    (n = 8 -> 4 + 4, n = 6 -> 4 + 2, n = 3 -> 2 + 1), and its value is left + right.

Rank r of W owns the leaves (microbatches) [r*V/W, (r+1)*V/W). While it runs its microbatches it
merges finished siblings at once (a stack: the right operand is added into the left one and its
buffer handed back to the caller's `release`), so it ends holding the maximal tree nodes inside
its block. Gradient buffers held at once, the incoming leaf included: log2(V/W) + 1 when V/W is
a power of two (any W: the block is then one subtree); otherwise at most 2*floor(log2(V/W)) + 1
(checked for every V <= 256 and every W dividing it; V = 6 at W = 2: 3). The flat gradient is
cut into W contiguous chunks (c = ceil(N/W) elements, the last ones shorter or empty) and rank q
receives chunk q of every other rank's partials. Each rank then evaluates the top of the same
tree for its chunk, and an all-gather puts the chunks together (replicated data parallel; FSDP
keeps its chunk). Every addition is elementwise, so cutting the vector into chunks changes
nothing, and each tree node is computed as left + right wherever it is computed (in place into
the left operand's buffer, which gives the same bits). How the chunks travel (below) moves bytes
only and never changes an addition.

Cost. For V/W a power of two every block is one subtree: each rank sends one partial
(N/W elements to each peer), then its reduced chunk to each peer: the volume of a ring
reduce-scatter + all-gather, and the additions of a reduction ((V/W - 1) N locally, (W - 1) N/W
for the tree top). Transport, with every rank of a gloo group on one host (the usual case on
CPU): a shared-memory file mapped by all of them (trainer/shared_exchange.py); each rank copies
the chunks the others need into its slots, a barrier, the tree top reads them where they lie, the
reduced chunk goes into a shared vector, a barrier, the other chunks are copied out (10 MB at W =
2: ~14 ms over gloo's loopback TCP -> a few ms). Otherwise (ranks on several hosts, or the file
cannot be made; `TITAN_AUDIT_SHARED_EXCHANGE=0`), on gloo:
- up to COLLECTIVE_MAX_BYTES (4 MB), both steps are one all_to_all_single each (gloo runs a
  collective in one call on its own thread; point-to-point messages pay a handshake each). Copies:
  the gather sends W copies of the chunk (N elements, into a scratch buffer), and with several
  partials per rank (W not a power of two, or V/W not one subtree) they are packed by destination;
- above it, point-to-point isend/irecv in ring order straight from the partials and into place:
  no copies. Received chunks land in a scratch buffer, the tree top is added in place into this
  rank's chunk of its first partial, and the other chunks are gathered around it.
Scratch buffers are kept across calls (a fresh buffer of tens of MB costs page faults comparable to
the exchange itself), so a step allocates nothing. all_reduce returns the first gradient buffer
this rank added, now holding the full sum; the other partials go to `release` once the reduce is
done with them. Pipelining the exchange in buckets (tried: 1-16 MB) gave no measurable gain on
gloo here and cost CPU per message, so there is one bucket.

Devices: the reducer works on the gradients where they are (scratch buffers on their device): CPU
tensors over gloo, CUDA tensors over NCCL (`parallel.device = "cuda"`; checks.check_backend
refuses the other pairings). Every addition is the same elementwise IEEE add on either device, and
the collectives move bytes only. `gather_in_index_order` takes a tensor on any device and gathers
it on the device the group's backend moves (gloo: CPU, NCCL: this rank's GPU), returning it
where it came from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_audit.audit.exchange import transport_device
from titan_audit.trainer.shared_exchange import SharedExchange

Node = tuple[int, int]  # [lo, hi) over microbatch indices
Release = Callable[[torch.Tensor], None]  # receives a gradient buffer the reducer no longer needs

# torch 2.13 renamed all_gather_into_tensor to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


GATHER_TAG = 1 << 16  # point-to-point tag of the all-gather; the exchange uses 0, 1, ... per partial
# Up to this many gradient bytes the exchange and the gather are gloo all_to_all_single collectives,
# above it point-to-point messages. Measured (gloo, torch 2.13, 2 cores, median): exchange at 1 MB,
# W = 2: 0.5 ms (collective) vs 2.5 ms (p2p); all-gather at 64 MB, W = 2: 22 ms (collective with
# the chunk copied W times) vs 12.5 ms (p2p, no copy); about even at 4 MB.
COLLECTIVE_MAX_BYTES = 4 << 20


def tree_top(values: dict[Node, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Node [lo, hi) of the canonical tree from the values of nodes below it, adding in place into
    the left operand (the buffers in `values` are spent)."""
    if (lo, hi) in values:
        return values[(lo, hi)]
    mid = split_point(lo, hi)
    return tree_top(values, lo, mid).add_(tree_top(values, mid, hi))  # left + right


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Chunk q = [q*c, (q+1)*c) clipped to [0, numel), c = ceil(numel / W); trailing chunks may be empty."""
    c = -(-numel // world_size)
    return [(min(q * c, numel), min((q + 1) * c, numel)) for q in range(world_size)]


def split_point(lo: int, hi: int) -> int:
    """Where the canonical tree splits node [lo, hi): the left child is a power of two."""
    n = hi - lo
    assert n > 1, (lo, hi)
    return lo + (1 << ((n - 1).bit_length() - 1))


@functools.cache
def tree_nodes(num_leaves: int) -> frozenset[Node]:
    """Every node of the canonical tree over [0, num_leaves)."""
    nodes: set[Node] = set()
    stack = [(0, num_leaves)]
    while stack:
        lo, hi = stack.pop()
        nodes.add((lo, hi))
        if hi - lo > 1:
            mid = split_point(lo, hi)
            stack += [(lo, mid), (mid, hi)]
    return frozenset(nodes)


def block_subtrees(num_leaves: int, start: int, stop: int) -> list[Node]:
    """The maximal canonical tree nodes inside [start, stop), left to right."""
    out: list[Node] = []

    def visit(lo: int, hi: int) -> None:
        if start <= lo and hi <= stop:
            out.append((lo, hi))
        elif lo < stop and start < hi:
            mid = split_point(lo, hi)
            visit(lo, mid)
            visit(mid, hi)

    visit(0, num_leaves)
    return out


def tree_sum(values: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Sum of values[lo:hi] (along dim 0) in the fixed tree order of this module (depends on the
    count alone): how the loops sum their per-microbatch step figures."""
    hi = values.shape[0] if hi is None else hi
    if hi - lo == 1:
        return values[lo]
    mid = split_point(lo, hi)
    return tree_sum(values, lo, mid) + tree_sum(values, mid, hi)


def gather_in_index_order(local: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's block of `group` (W ranks) concatenated along dim 0 (rank order = microbatch
    index order), on `local`'s device (moved for the transport when the backend needs another:
    bytes copied, never changed)."""
    if world_size == 1:
        return local
    wire = transport_device(group)
    send = local.contiguous().to(wire)
    out = torch.empty((local.shape[0] * world_size, *local.shape[1:]), dtype=local.dtype, device=wire)
    all_gather_single(out.view(-1), send.view(-1), group=group)
    return out.to(local.device)


# all_reduce_partials: up to this many bytes one all-gather + local tree, above it a TreeReducer.
# Measured (gloo, 2 cores, W = 2 and 4): the gather is faster than dist.all_reduce up to ~1 MB and
# 1.4-2.5x slower at 3 MB, where the reducer's reduce-scatter + all-gather wins.
PARTIALS_GATHER_MAX_BYTES = 1 << 20
_PARTIAL_REDUCERS: dict[tuple[int, int], TreeReducer] = {}


def all_reduce_partials(partial: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum of every rank's `partial` (same shape and dtype on each) in the canonical tree order
    over the group's rank index: rank r's partial is leaf r, so the bits are the same on every rank
    and equal `tree_sum` of the partials stacked in rank order, whatever the transport.

    This is the fixed-order all-reduce for tensor-parallel partial sums (the TP linears of
    models/tensor_parallel.py use it, installed by trainer/tensor_parallel.py): when rank r holds the sum
    over its shard of a reduced dimension and the shards are whole subtrees of the reduction's own
    tree (a power-of-two number of equal shards of a halving tree), the result is the unsharded
    reduction's bits. A plain `dist.all_reduce` promises no order (gloo and NCCL pick one by size
    and topology). Transport (it moves bytes only, so it never changes the bits): up to
    PARTIALS_GATHER_MAX_BYTES, one all-gather of the partials and the tree locally (the latency of
    one collective, W - 1 additions of N on every rank); above it `TreeReducer` with one leaf per
    rank (the volume of a ring all-reduce). `partial`'s buffer may be overwritten.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size(group) if distributed else 1
    if world_size == 1:
        return partial
    local = partial.contiguous()
    if local.numel() * local.element_size() > PARTIALS_GATHER_MAX_BYTES:
        key = (id(group), world_size)
        reducer = _PARTIAL_REDUCERS.get(key)
        if reducer is None:
            reducer = _PARTIAL_REDUCERS[key] = TreeReducer(world_size, group)
        reducer.add(reducer.rank, local.view(-1))
        return reducer.all_reduce().view(local.shape)
    stacked = torch.empty((world_size, *local.shape), dtype=local.dtype, device=local.device)
    all_gather_single(stacked.view(-1), local.view(-1), group=group)
    return tree_sum(stacked)


class TreeStack:
    """The canonical tree over leaves arriving in index order, merged as soon as siblings are both
    there: leaf i is pushed after leaves start..i-1; whenever the top two entries are the two
    children of a tree node they become that node, computed in place into the left one's buffer
    (left + right) and the right one's buffer goes to `release`. The stack then holds the maximal
    tree nodes over the leaves pushed so far: at most one per level of the tree (depth + 1)."""

    def __init__(self, num_leaves: int, start: int = 0, release: Release | None = None) -> None:
        self.num_leaves, self.start = num_leaves, start
        self._tree = tree_nodes(num_leaves)
        self._release = release
        self.nodes: list[tuple[int, int, torch.Tensor]] = []
        self.next = start

    def push(self, value: torch.Tensor) -> None:
        """Leaf `self.next`'s value (the stack owns its buffer from now on)."""
        assert self.next < self.num_leaves, (self.next, self.num_leaves)
        self.nodes.append((self.next, self.next + 1, value))
        self.next += 1
        while len(self.nodes) >= 2:
            (lo, mid, left), (mid2, hi, right) = self.nodes[-2], self.nodes[-1]
            assert mid == mid2
            if (lo, hi) not in self._tree or split_point(lo, hi) != mid:
                break
            self.nodes[-2:] = [(lo, hi, left.add_(right))]  # node value = left + right
            if self._release is not None:
                self._release(right)

    def take(self) -> list[tuple[int, int, torch.Tensor]]:
        """The nodes held (their buffers pass to the caller) and a fresh start."""
        nodes, self.nodes, self.next = self.nodes, [], self.start
        return nodes


def rank_block(num_microbatches: int, world_size: int, rank: int) -> tuple[int, int]:
    """Microbatches [start, stop) that `rank` processes. W must divide V."""
    if world_size < 1 or num_microbatches % world_size:
        raise ValueError(f"world size {world_size} must divide the number of virtual microbatches {num_microbatches}")
    per_rank = num_microbatches // world_size
    return rank * per_rank, (rank + 1) * per_rank


class TreeReducer:
    """Sums per-microbatch flat gradients in the canonical tree order, across ranks.

        reducer = TreeReducer(V, group=None, release=pool.give)  # W and rank from the process group
        for i in range(*reducer.block):
            reducer.add(i, flat_grad_i)  # takes ownership; may add in place
        full = reducer.all_reduce()      # same bits on every rank and every W
        pool.give(full)                  # once the caller is done with it

    Buffer ownership: `add` takes the gradient buffer; every buffer the reducer no longer needs goes
    to `release` (if given; else it is dropped): the right operand of each merge as soon as it is
    added into the left one, and after a reduce every partial but the returned one. The result
    lives in the first gradient buffer added, which passes back to the caller. So a caller that
    takes each leaf from a pool and gives back what `release` receives and the result holds at
    most log2(V/W) + 1 buffers at once when V/W is a power of two (module docstring).
    The reducer's own scratch (kept across calls, so a step allocates nothing) is apart from these:
    on gloo a receive buffer of one chunk per partial of the other ranks ((W - 1) chunks, under N
    elements, when V/W is a power of two), and up to COLLECTIVE_MAX_BYTES a send buffer of N
    elements; on one host the shared file instead.
    Without a process group (or W == 1) it reduces locally.
    """

    def __init__(
        self, num_microbatches: int, group: dist.ProcessGroup | None = None, release: Release | None = None
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.num_microbatches = num_microbatches
        self.block = rank_block(num_microbatches, self.world_size, self.rank)
        self.layout = [
            block_subtrees(num_microbatches, *rank_block(num_microbatches, self.world_size, r))
            for r in range(self.world_size)
        ]
        self._stack = TreeStack(num_microbatches, self.block[0], self._give_back)
        self._buffers: dict[str, torch.Tensor] = {}
        self._slots_per_rank = max(len(nodes) for nodes in self.layout)  # partials a rank can hold
        self._shared: SharedExchange | None = None
        self._shared_refused = False  # the ranks could not share a region: gloo from then on
        self._release = release

    def add(self, index: int, flat_grad: torch.Tensor) -> None:
        """Add microbatch `index`'s gradient (1-D). Indices must come in order through the block."""
        if index != self._stack.next:
            raise ValueError(f"microbatch {index} added out of order; expected {self._stack.next} (block {self.block})")
        assert flat_grad.dim() == 1, flat_grad.shape
        nodes = self._stack.nodes
        if nodes and (flat_grad.shape, flat_grad.dtype) != (nodes[0][2].shape, nodes[0][2].dtype):
            first = nodes[0][2]
            raise ValueError(
                f"microbatch {index}: gradient {flat_grad.dtype}{list(flat_grad.shape)}, "
                f"expected {first.dtype}{list(first.shape)}"
            )
        self._stack.push(flat_grad)

    def _give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` is spent (added into another, or sent): to `release`, if given."""
        if self._release is not None:
            self._release(buffer)

    def _partials(self) -> list[torch.Tensor]:
        if self._stack.next != self.block[1]:
            raise ValueError(
                f"reduce called after microbatches {self.block[0]}..{self._stack.next - 1} of block {self.block}"
            )
        assert [(lo, hi) for lo, hi, _ in self._stack.nodes] == self.layout[self.rank]
        return [t for _, _, t in self._stack.take()]

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch buffer kept across calls (a fresh buffer of tens of MB costs page faults
        comparable to the exchange itself)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def _local_total(self) -> torch.Tensor:
        """W == 1: the stack holds the root alone, the whole sum."""
        partials = self._partials()
        assert len(partials) == 1, len(partials)
        return partials[0]

    def _reduce(self, gather: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Reduce this rank's chunk into its first partial, then all-gather the chunks into that
        partial if `gather`. Returns (that partial, the chunk bounds); the other partials, sent and
        added by then (every send waited for, every shared-file read behind a barrier), go to
        `release`."""
        partials = self._partials()
        out = partials[0]
        bounds = chunk_bounds(out.numel(), self.world_size)
        start, stop = bounds[self.rank]
        shared = self._shared_exchange(out)
        collective = out.numel() * out.element_size() <= COLLECTIVE_MAX_BYTES
        if shared is not None:
            values = self._exchange_shared(shared, partials, bounds)
        else:
            values = (self._exchange_collective if collective else self._exchange_p2p)(partials, bounds)
        mid = split_point(0, self.num_microbatches)
        # The root's operands are views disjoint from out[start:stop], or that very view.
        torch.add(tree_top(values, 0, mid), tree_top(values, mid, self.num_microbatches), out=out[start:stop])
        if shared is not None:
            self._gather_shared(shared, out, bounds, gather)
        elif gather:
            (self._gather_collective if collective else self._gather_p2p)(out, bounds)
        for partial in partials[1:]:
            self._give_back(partial)
        return out, bounds

    @property
    def transport(self) -> str:
        """How the last reduce moved the chunks: "shared file" (one host) or "gloo"."""
        return "shared file" if self._shared is not None else "gloo"

    def _shared_exchange(self, like: torch.Tensor) -> SharedExchange | None:
        """The same-host region for gradients like `like`: opened (collectively: every rank reduces
        the same shapes in the same order, so they decide alike) at the first reduce, regrown for a
        larger one; once the ranks cannot share one, gloo for good (no collective per call)."""
        if like.device.type != "cpu" or self._shared_refused:
            return None
        if self._shared is not None and self._shared.fits(like.numel(), like.dtype, self._slots_per_rank):
            return self._shared
        capacity = max(like.numel(), self._shared.capacity if self._shared is not None else 0)
        self._shared = None  # drop the old mapping first
        self._shared = SharedExchange.open(capacity, like.dtype, self._slots_per_rank, self.group)
        self._shared_refused = self._shared is None
        return self._shared

    def _exchange_shared(
        self, shared: SharedExchange, partials: list[torch.Tensor], bounds: list[tuple[int, int]]
    ) -> dict[Node, torch.Tensor]:
        """Each partial's chunks for the other ranks into this rank's slots, a barrier, and every
        block subtree's value on this rank's chunk, read where it lies (`tree_top` then adds in
        place into some of them: chunk r of every slot is rank r's alone until the next reduce)."""
        numel = partials[0].numel()
        for i, partial in enumerate(partials):
            slot = shared.slot(self.rank, i, numel)
            for q, (lo, hi) in enumerate(bounds):
                if q != self.rank and hi > lo:
                    slot[lo:hi].copy_(partial[lo:hi])
        dist.barrier(group=self.group)  # every rank's slots are written
        start, stop = bounds[self.rank]
        values = {node: p[start:stop] for node, p in zip(self.layout[self.rank], partials)}
        for q, nodes in enumerate(self.layout):
            if q != self.rank:
                values.update({node: shared.slot(q, i, numel)[start:stop] for i, node in enumerate(nodes)})
        return values

    def _gather_shared(
        self, shared: SharedExchange, out: torch.Tensor, bounds: list[tuple[int, int]], gather: bool
    ) -> None:
        """This rank's reduced chunk into the shared vector, a barrier, the other chunks out of it.
        The barrier also ends every read of the slots, so the next reduce's writes cannot overtake
        a slower rank's reads; and a rank writes the shared vector again only after the next
        reduce's first barrier, which every rank reaches after its copies here."""
        start, stop = bounds[self.rank]
        gathered = shared.gathered(out.numel())
        if gather:
            gathered[start:stop].copy_(out[start:stop])
        dist.barrier(group=self.group)
        if gather:
            for q, (lo, hi) in enumerate(bounds):
                if q != self.rank and hi > lo:
                    out[lo:hi].copy_(gathered[lo:hi])

    def _exchange_p2p(self, partials: list[torch.Tensor], bounds: list[tuple[int, int]]) -> dict[Node, torch.Tensor]:
        """Chunk q of every partial goes to rank q, point to point in ring order, straight from and
        into place. Returns every block subtree's value on this rank's chunk."""
        start, stop = bounds[self.rank]
        size = stop - start
        foreign = [(q, node) for q, nodes in enumerate(self.layout) if q != self.rank for node in nodes]
        recv = self._buffer("recv", len(foreign) * size, partials[0])
        values = {node: p[start:stop] for node, p in zip(self.layout[self.rank], partials)}
        sources: dict[int, list[torch.Tensor]] = {q: [] for q in range(self.world_size)}
        for slot, (q, node) in enumerate(foreign):
            values[node] = recv[slot * size : (slot + 1) * size]
            sources[q].append(values[node])
        works: list[dist.Work] = []
        for step in range(1, self.world_size):
            src, dst = (self.rank - step) % self.world_size, (self.rank + step) % self.world_size
            if size:
                for tag, slot in enumerate(sources[src]):
                    works.append(self._p2p(dist.irecv, slot, src, tag))
            dst_start, dst_stop = bounds[dst]
            if dst_stop > dst_start:
                for tag, partial in enumerate(partials):
                    works.append(self._p2p(dist.isend, partial[dst_start:dst_stop], dst, tag))
        for work in works:
            work.wait()
        return values

    def _exchange_collective(
        self, partials: list[torch.Tensor], bounds: list[tuple[int, int]]
    ) -> dict[Node, torch.Tensor]:
        """The same exchange as one all_to_all_single (this rank's own chunks included)."""
        start, stop = bounds[self.rank]
        size = stop - start
        nodes = [node for rank_nodes in self.layout for node in rank_nodes]
        recv = self._buffer("recv", len(nodes) * size, partials[0])
        if len(partials) == 1:
            send = partials[0]  # already laid out destination by destination
        else:
            send = self._buffer("send", len(partials) * partials[0].numel(), partials[0])
            offset = 0
            for lo, hi in bounds:
                for p in partials:
                    send[offset : offset + hi - lo].copy_(p[lo:hi])
                    offset += hi - lo
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[len(rank_nodes) * size for rank_nodes in self.layout],
            input_split_sizes=[len(partials) * (hi - lo) for lo, hi in bounds],
            group=self.group,
        )
        return {node: recv[i * size : (i + 1) * size] for i, node in enumerate(nodes)}

    def _gather_p2p(self, out: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        start, stop = bounds[self.rank]
        works: list[dist.Work] = []
        for step in range(1, self.world_size):
            src, dst = (self.rank - step) % self.world_size, (self.rank + step) % self.world_size
            src_start, src_stop = bounds[src]
            if src_stop > src_start:
                works.append(self._p2p(dist.irecv, out[src_start:src_stop], src, GATHER_TAG))
            if stop > start:
                works.append(self._p2p(dist.isend, out[start:stop], dst, GATHER_TAG))
        for work in works:
            work.wait()

    def _gather_collective(self, out: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        """The all-gather as one all_to_all_single of W copies of this rank's chunk."""
        start, stop = bounds[self.rank]
        send = self._buffer("send", self.world_size * (stop - start), out)
        send.view(self.world_size, stop - start).copy_(out[start:stop])  # broadcasts
        dist.all_to_all_single(
            out,
            send,
            output_split_sizes=[hi - lo for lo, hi in bounds],
            input_split_sizes=[stop - start] * self.world_size,
            group=self.group,
        )

    def _p2p(self, op: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        work = op(tensor, group=self.group, tag=tag, **{"group_dst" if op is dist.isend else "group_src": peer})
        assert work is not None
        return work

    def reduce_scatter(self) -> tuple[torch.Tensor, int, int]:
        """This rank's chunk of the reduced gradient, as (chunk, start, stop) element offsets.

        Chunk q covers elements [q*c, min((q+1)*c, N)) with c = ceil(N / W). The chunk is a view of
        the first gradient this rank added, whose buffer passes back to the caller.
        """
        if self.world_size == 1:
            total = self._local_total()
            return total, 0, total.numel()
        out, bounds = self._reduce(gather=False)
        start, stop = bounds[self.rank]
        return out[start:stop], start, stop

    def all_reduce(self) -> torch.Tensor:
        """The full reduced gradient, bitwise the same on every rank (replicated data parallel).

        It is returned in the buffer of the first gradient this rank added, which passes back to
        the caller (never to `release`)."""
        if self.world_size == 1:
            return self._local_total()
        return self._reduce(gather=True)[0]
