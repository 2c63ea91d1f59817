"""KV caches for prefill and decode: a contiguous cache and a paged-block cache.

How the model uses a cache (the same three calls for both kinds):

    step = cache.begin(num_new_tokens)     # reserve room; step.q_pos_BT = absolute positions
    keys = step.update(layer, k_new_BHTD, v_new_BHTD)   # per layer: write, then the keys to read
    step.commit()                          # after all layers: the new tokens count as cached

`update` returns the keys and values to attend over: for a contiguous cache a pair (k_BHSD,
v_BHSD) for `models.ops.attention`; for a paged cache a `PagedKeys` (the layer's blocks as views
of the store, the rows' block tables and lengths) for `models.ops.paged_attention`, which in BI
mode reads them through the block table with no dense copy (`PagedKeys.gather()` gives the same
keys as a dense pair, what native mode and autograd attend over).

Guarantees:
- Key `j` of what `update` returns (of the pair; of a `PagedKeys` through its table, and of its
  `gather()`) is the token at absolute position `j` of that row's sequence, for every `j` up to
  the row's length after this step; entries beyond a row's length (other rows are longer, or
  block padding) hold arbitrary values and are invisible to that row's queries by causality. So
  attention over them gives exactly what a full forward would see.
- Rows of one step may have different lengths; every row gets `num_new_tokens` new tokens.
- A step that is never committed leaves lengths unchanged (its writes sit beyond the lengths).
- Running out of room (`max_len`, free blocks) raises `ValueError` before anything is written.

`ContiguousKVCache(config, batch_size, max_len)` holds [layers, batch, kv_heads, max_len, head_dim]
buffers; `cache.rows([i, ...])` is a view over some rows (prefill sequences one at a time, then
decode them together). `PagedKVCache(config, num_blocks, block_size)` holds fixed-size blocks that
sequences (any hashable id) take from a free list as they grow, as a continuous-batching generator
needs: `add(seq)`, `batch([seq, ...]).begin(T)`, `fork(seq, new_seq)`, `truncate(seq, n)`,
`release(seq)`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from titan_audit.models.config import ModelConfig


def _buffers(
    config: ModelConfig, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    full = (config.num_hidden_layers, *shape)
    return (
        torch.zeros(full, dtype=dtype, device=device),
        torch.zeros(full, dtype=dtype, device=device),
    )


class ContiguousKVCache:
    """One [kv_heads, max_len, head_dim] slab per (layer, row); rows may have different lengths."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size and max_len must be > 0, got {batch_size}, {max_len}")
        self.max_len = max_len
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.k, self.v = _buffers(config, shape, dtype, device)
        self.lengths = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def rows(self, rows: Sequence[int]) -> _ContiguousRows:
        """A view over some rows, usable as the model's `cache` argument."""
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not 0 <= r < self.batch_size]
        if bad or not rows or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct indices in [0, {self.batch_size}), got {rows}")
        return _ContiguousRows(self, rows)

    def begin(self, num_tokens: int) -> _ContiguousStep:
        return self.rows(range(self.batch_size)).begin(num_tokens)


class _ContiguousRows:
    def __init__(self, cache: ContiguousKVCache, rows: list[int]) -> None:
        self.cache = cache
        self.row_list = rows

    def begin(self, num_tokens: int) -> _ContiguousStep:
        return _ContiguousStep(self.cache, self.row_list, num_tokens)


class _ContiguousStep:
    def __init__(self, cache: ContiguousKVCache, rows: list[int], num_tokens: int) -> None:
        starts = [cache.lengths[r] for r in rows]
        if max(starts) + num_tokens > cache.max_len:
            raise ValueError(
                f"KV cache full: a row at length {max(starts)} cannot take {num_tokens} more tokens "
                f"(max_len {cache.max_len})"
            )
        device = cache.k.device
        self.cache = cache
        self.rows = rows
        self.num_tokens = num_tokens
        self.row_idx_B = torch.tensor(rows, dtype=torch.long, device=device)
        start_B = torch.tensor(starts, dtype=torch.long, device=device)
        self.q_pos_BT = start_B[:, None] + torch.arange(num_tokens, device=device)[None, :]
        self.num_keys = max(starts) + num_tokens

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_store, v_store = self.cache.k[layer], self.cache.v[layer]
        rows_BT = self.row_idx_B[:, None].expand_as(self.q_pos_BT)
        k_store[rows_BT, :, self.q_pos_BT] = k_BHTD.transpose(1, 2).to(k_store.dtype)
        v_store[rows_BT, :, self.q_pos_BT] = v_BHTD.transpose(1, 2).to(v_store.dtype)
        keys = slice(0, self.num_keys)
        return k_store[self.row_idx_B, :, keys], v_store[self.row_idx_B, :, keys]

    def commit(self) -> None:
        for r in self.rows:
            self.cache.lengths[r] += self.num_tokens


class PagedKVCache:
    """Fixed-size blocks shared by many sequences; each sequence has a block table."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # token-major blocks [block, slot, kv_head, head_dim]: a new token is one row of a block;
        # the paged attention kernels read the [block, kv_head, slot, head_dim] view in place, and
        # a gather is one index_select of a batch's blocks, viewed as [B, heads, S, head_dim]
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k, self.v = _buffers(config, shape, dtype, device)
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest free block first
        self.block_tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def add(self, seq: Hashable) -> None:
        """Start an empty sequence `seq`."""
        if seq in self.lengths:
            raise ValueError(f"sequence {seq!r} is already in the cache")
        self.block_tables[seq] = []
        self.lengths[seq] = 0

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Start sequence `dst` as a copy of `src`'s cached tokens (e.g. n samples of one prompt).

        The blocks are copied (no sharing, so later writes of either sequence never touch the
        other); the copy is exact, so `dst` decodes bitwise as `src` would.
        """
        self._check(src)
        if dst in self.lengths:
            raise ValueError(f"sequence {dst!r} is already in the cache")
        blocks = self.block_tables[src]
        if len(blocks) > len(self._free):
            raise ValueError(f"paged KV cache full: fork needs {len(blocks)} blocks, {len(self._free)} free")
        copies = [heapq.heappop(self._free) for _ in blocks]
        if blocks:
            source = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
            target = torch.tensor(copies, dtype=torch.long, device=self.k.device)
            self.k[:, target] = self.k[:, source]
            self.v[:, target] = self.v[:, source]
        self.block_tables[dst] = copies
        self.lengths[dst] = self.lengths[src]

    def truncate(self, seq: Hashable, length: int) -> None:
        """Keep only the first `length` cached tokens of `seq` (e.g. after a right-padded prefill);
        blocks past the last one still needed go back to the free list. Entries beyond the new
        length keep arbitrary values, invisible to later queries as after any step."""
        self._check(seq)
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq!r} of length {self.lengths[seq]} to {length}")
        table = self.block_tables[seq]
        keep = -(-length // self.block_size)
        for block in table[keep:]:
            heapq.heappush(self._free, block)
        del table[keep:]
        self.lengths[seq] = length

    def release(self, seq: Hashable) -> None:
        """Drop sequence `seq` and return its blocks to the free list."""
        self._check(seq)
        for block in self.block_tables.pop(seq):
            heapq.heappush(self._free, block)
        del self.lengths[seq]

    def length(self, seq: Hashable) -> int:
        self._check(seq)
        return self.lengths[seq]

    def batch(self, seqs: Sequence[Hashable]) -> _PagedBatch:
        """The sequences `seqs` as one batch (row i = seqs[i]), usable as the model's `cache`."""
        seqs = list(seqs)
        for seq in seqs:
            self._check(seq)
        if not seqs or len(set(seqs)) != len(seqs):
            raise ValueError(f"a batch needs distinct sequences, got {seqs}")
        return _PagedBatch(self, seqs)

    def _check(self, seq: Hashable) -> None:
        if seq not in self.lengths:
            raise ValueError(f"unknown sequence {seq!r}; add() it first")

    def _reserve(self, seqs: list[Hashable], num_tokens: int) -> None:
        """Give every sequence enough blocks for num_tokens more tokens (all or nothing)."""
        needed = {
            seq: -(-(self.lengths[seq] + num_tokens) // self.block_size) - len(self.block_tables[seq]) for seq in seqs
        }
        total = sum(max(0, n) for n in needed.values())
        if total > len(self._free):
            raise ValueError(
                f"paged KV cache full: {total} blocks needed, {len(self._free)} free "
                f"(num_blocks {self.num_blocks}, block_size {self.block_size})"
            )
        for seq in seqs:
            for _ in range(max(0, needed[seq])):
                self.block_tables[seq].append(heapq.heappop(self._free))


@dataclass(frozen=True)
class PagedKeys:
    """One layer's keys and values in a paged cache, as a step leaves them: key j of row b at
    block `table_BN[b, j // block_size]`, slot `j % block_size` of `k_NHSD` / `v_NHSD`."""

    k_NHSD: torch.Tensor  # [num_blocks, kv_heads, block_size, head_dim]: a strided view of the store
    v_NHSD: torch.Tensor
    table_BN: torch.Tensor  # long; a row's entries past its own blocks are block 0 (keys past its length)
    seq_lens_B: torch.Tensor  # long: the keys each row holds after the step
    max_seq_len: int  # the longest row's length

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' blocks in table order as dense k, v [B, kv_heads, blocks * block_size, head_dim]:
        one copy each (index_select of the store's token-major blocks), then a transposed view."""
        batch, num_table_blocks = self.table_BN.shape
        flat = self.table_BN.reshape(-1)
        dense = []
        for view_NHSD in (self.k_NHSD, self.v_NHSD):
            blocks_NSHD = view_NHSD.transpose(1, 2).index_select(0, flat)
            _, block_size, heads, head_dim = blocks_NSHD.shape
            dense.append(blocks_NSHD.view(batch, num_table_blocks * block_size, heads, head_dim).transpose(1, 2))
        return dense[0], dense[1]


class _PagedBatch:
    def __init__(self, cache: PagedKVCache, seqs: list[Hashable]) -> None:
        self.cache = cache
        self.seqs = seqs

    def begin(self, num_tokens: int) -> _PagedStep:
        self.cache._reserve(self.seqs, num_tokens)
        return _PagedStep(self.cache, self.seqs, num_tokens)


class _PagedStep:
    def __init__(self, cache: PagedKVCache, seqs: list[Hashable], num_tokens: int) -> None:
        device = cache.k.device
        block_size = cache.block_size
        self.cache = cache
        self.seqs = seqs
        self.num_tokens = num_tokens
        start_B = torch.tensor([cache.lengths[s] for s in seqs], dtype=torch.long, device=device)
        self.q_pos_BT = start_B[:, None] + torch.arange(num_tokens, device=device)[None, :]
        tables = [cache.block_tables[s] for s in seqs]
        num_table_blocks = max(len(t) for t in tables)
        # Rows with fewer blocks are padded with block 0: those keys lie beyond the row's length.
        self.table_BN = torch.tensor(
            [t + [0] * (num_table_blocks - len(t)) for t in tables], dtype=torch.long, device=device
        )
        self.block_BT = self.table_BN.gather(1, self.q_pos_BT // block_size)
        self.offset_BT = self.q_pos_BT % block_size
        self.seq_lens_B = start_B + num_tokens
        self.num_keys = max(cache.lengths[s] for s in seqs) + num_tokens

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> PagedKeys:
        k_store, v_store = self.cache.k[layer], self.cache.v[layer]  # [block, slot, kv_head, head_dim]
        k_store[self.block_BT, self.offset_BT] = k_BHTD.transpose(1, 2).to(k_store.dtype)
        v_store[self.block_BT, self.offset_BT] = v_BHTD.transpose(1, 2).to(v_store.dtype)
        return PagedKeys(
            k_store.transpose(1, 2), v_store.transpose(1, 2), self.table_BN, self.seq_lens_B, self.num_keys
        )

    def commit(self) -> None:
        for seq in self.seqs:
            self.cache.lengths[seq] += self.num_tokens
