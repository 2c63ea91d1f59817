"""Packing documents into fixed-length sequences, with per-token document ids and positions.

Every document is followed by EOS; a document "item" is its tokens plus that EOS (n + 1 slots).
Two modes, both fixed by the token store and the sequence length L alone (never by the seed,
the epoch or the world size), so a sequence index j names the same tokens forever:

concat  The items of all documents, in store order, form one stream of S = num_tokens + num_docs
        slots. Sequence j is the window of L + 1 slots starting at j * L (windows overlap by one
        slot so every position has a real target): j in [0, (S - 1) // L). No token is padding.
        The plan is the offsets array alone; a window is located by binary search, O(log D).

best_fit  Items never split unless longer than L: an item of m > L slots is cut into m // L full
        pieces of L slots (each its own sequence) and one remainder. Remaining items are placed
        by best-fit decreasing (longest first, ties by document id; each goes into the open bin
        with the least room that fits it, else a new bin). Bins are padded to L with PAD. The
        plan (O(D) integers, identical on every rank) is built once when the packer is made.

Per sequence (arrays of length L): tokens; targets (the next slot's token: targets[i] =
tokens[i + 1] within the window, PAD after the last item of a best-fit bin); positions (the RoPE
position, always in [0, L)): the offset of the token inside its document, except that a document
whose item is longer than L counts from 0 again in every piece: in best_fit its full pieces and
its remainder, in concat its part in each window (measured from the window's first slot). So
with L <= the model's max_position_embeddings no position leaves the model's context, however
long the document; a document that fits in L slots keeps its own offsets (in concat across a
window boundary too). 0 for PAD. doc_ids (store document index, -1 for PAD); loss_mask (True
where the target is the next token of the same document: same doc id and position + 1). So the
EOS-to-next-document target and padding never count. The count of True in loss_mask is known
from the plan without reading tokens (`loss_tokens`): concat L - (number of EOS in slots
[jL, jL + L)); best_fit sum over the bin's pieces of (length - 1).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from titan_audit.data.token_store import TokenStore

PACKINGS = ("concat", "best_fit")


@dataclass
class SequenceArrays:
    tokens: np.ndarray  # int64 [L]
    targets: np.ndarray  # int64 [L]
    positions: np.ndarray  # int64 [L]
    doc_ids: np.ndarray  # int64 [L]
    loss_mask: np.ndarray  # bool [L]


def _mask(doc: np.ndarray, pos: np.ndarray, next_doc: np.ndarray, next_pos: np.ndarray) -> np.ndarray:
    return (doc >= 0) & (next_doc == doc) & (next_pos == pos + 1)


class ConcatPacker:
    mode = "concat"

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.store, self.seq_len = store, seq_len
        offsets = store.offsets
        self.item_starts = offsets + np.arange(len(offsets), dtype=np.int64)  # A_d: slot where doc d begins
        self.eos_slots = self.item_starts[1:] - 1  # slot of doc d's EOS
        self.lengths = np.diff(offsets)
        slots = store.num_tokens + store.num_docs
        self.num_sequences = (slots - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(
                f"{store.path}: {slots} token slots cannot fill one sequence of length {seq_len} (+1 target)"
            )
        self.eos_id = store.info.eos_id

    def sequence(self, j: int) -> SequenceArrays:
        L = self.seq_len
        slots = np.arange(j * L, j * L + L + 1, dtype=np.int64)
        doc = np.searchsorted(self.item_starts, slots, side="right") - 1
        pos = slots - self.item_starts[doc]  # offset inside the document
        is_eos = pos == self.lengths[doc]
        raw = self.store.offsets[doc] + pos
        long = self.lengths[doc] + 1 > L  # cut into pieces: positions count from the window's start
        if long.any():
            pos = np.where(long, slots - np.maximum(self.item_starts[doc], j * L), pos)
        tokens = np.full(L + 1, self.eos_id, dtype=np.int64)
        real = ~is_eos
        if real.any():
            lo, hi = int(raw[real][0]), int(raw[real][-1]) + 1  # raw indices increase along the window
            tokens[real] = self.store.read(lo, hi)[raw[real] - lo]
        return SequenceArrays(tokens[:L], tokens[1:], pos[:L], doc[:L], _mask(doc[:L], pos[:L], doc[1:], pos[1:]))

    def loss_tokens(self, seq_ids: np.ndarray) -> np.ndarray:
        start = np.asarray(seq_ids, dtype=np.int64) * self.seq_len
        eos = np.searchsorted(self.eos_slots, start + self.seq_len) - np.searchsorted(self.eos_slots, start)
        return self.seq_len - eos


class BestFitPacker:
    mode = "best_fit"

    def __init__(self, store: TokenStore, seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError(f"best_fit packing needs seq_len >= 2, got {seq_len}")
        self.store, self.seq_len = store, seq_len
        self.eos_id, self.pad_id = store.info.eos_id, store.info.pad_id
        self.lengths = np.diff(store.offsets)
        self._plan(self.lengths + 1)

    def _plan(self, items: np.ndarray) -> None:
        L = self.seq_len
        full = items // L
        # Full pieces: one bin each, in document order.
        full_doc = np.repeat(np.arange(len(items), dtype=np.int64), full)
        first = np.cumsum(full) - full
        full_start = (np.arange(len(full_doc), dtype=np.int64) - np.repeat(first, full)) * L
        # Remainders: best-fit decreasing.
        rem = items - full * L
        rem_docs = np.nonzero(rem)[0]
        order = rem_docs[np.argsort(-rem[rem_docs], kind="stable")]
        bins: list[list[int]] = []
        room: dict[int, list[int]] = {}  # remaining room -> bins with that room (most recent last)
        rooms: list[int] = []  # sorted distinct rooms that have bins
        for d in order.tolist():
            size = int(rem[d])
            i = bisect.bisect_left(rooms, size)
            if i < len(rooms):
                r = rooms[i]
                b = room[r].pop()
                if not room[r]:
                    del room[r]
                    rooms.pop(i)
                bins[b].append(d)
                left = r - size
            else:
                b = len(bins)
                bins.append([d])
                left = L - size
            if left > 0:
                if left not in room:
                    room[left] = []
                    bisect.insort(rooms, left)
                room[left].append(b)
        counts = np.concatenate(
            [np.ones(len(full_doc), dtype=np.int64), np.array([len(b) for b in bins], dtype=np.int64)]
        )
        bin_docs = np.fromiter((d for b in bins for d in b), dtype=np.int64, count=int(sum(len(b) for b in bins)))
        self.piece_doc = np.concatenate([full_doc, bin_docs])
        self.piece_start = np.concatenate([full_start, full[bin_docs] * L])
        self.piece_len = np.concatenate([np.full(len(full_doc), L, dtype=np.int64), rem[bin_docs]])
        self.bin_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_sequences = len(counts)
        fill = np.add.reduceat(self.piece_len, self.bin_ptr[:-1]) if self.num_sequences else np.zeros(0, np.int64)
        self._loss = fill - counts
        assert self.num_sequences >= 1 and int(fill.max()) <= L

    def bin_pieces(self, j: int) -> list[tuple[int, int, int]]:
        """(doc id, start slot in the item, slot count) of each piece of sequence j, in order."""
        a, b = self.bin_ptr[j], self.bin_ptr[j + 1]
        return list(zip(self.piece_doc[a:b].tolist(), self.piece_start[a:b].tolist(), self.piece_len[a:b].tolist()))

    def sequence(self, j: int) -> SequenceArrays:
        L = self.seq_len
        tokens = np.full(L + 1, self.pad_id, dtype=np.int64)
        doc = np.full(L + 1, -1, dtype=np.int64)
        pos = np.zeros(L + 1, dtype=np.int64)
        at = 0
        for d, start, count in self.bin_pieces(j):
            n = int(self.lengths[d])
            stop = min(start + count, n)  # real tokens in [start, stop); EOS at n if included
            base = int(self.store.offsets[d])
            if stop > start:
                tokens[at : at + stop - start] = self.store.read(base + start, base + stop)
            if start + count == n + 1:
                tokens[at + count - 1] = self.eos_id
            doc[at : at + count] = d
            pos[at : at + count] = np.arange(count)  # every piece counts from 0 (docstring)
            at += count
        return SequenceArrays(tokens[:L], tokens[1:], pos[:L], doc[:L], _mask(doc[:L], pos[:L], doc[1:], pos[1:]))

    def loss_tokens(self, seq_ids: np.ndarray) -> np.ndarray:
        return self._loss[np.asarray(seq_ids, dtype=np.int64)]


def make_packer(store: TokenStore, seq_len: int, mode: str) -> ConcatPacker | BestFitPacker:
    if mode == "concat":
        return ConcatPacker(store, seq_len)
    if mode == "best_fit":
        return BestFitPacker(store, seq_len)
    raise ValueError(f"unknown packing {mode!r}; choose from {', '.join(PACKINGS)}")
