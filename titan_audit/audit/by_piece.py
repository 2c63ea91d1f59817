"""Digests of many named tensors recorded by the piece each rank holds, and their verification
by the ranks that hold the pieces later, at any layout (a checkpoint's hashes.json formats 2 and
3, whose lanes are lattice versions 1 and 2: trainer/checkpoint.py).

Guarantees:
- `digests_by_piece(named)` (collective; rank 0 gets the result): for every tensor, its
  fingerprint (audit.fingerprint, the same string as its audit record at any layout) and its
  pieces as the ranks held them: each piece's global index runs per dimension, the lattice
  lanes of its elements (audit/shards.py) and the ranks that held it. Each rank hashes only its
  own share: a DTensor's local piece (split by rows among the ranks of a Replicate mesh
  dimension), a plain tensor in a multi-rank run (replicated: DDP, or an FSDP optimizer's step
  count) 1/W of its rows. Exchanged: 16 bytes per tensor per rank, plus the pieces of the
  tensors of at most C bytes, which go whole to rank 0 for their xxh3 fingerprint.
- `verify_by_piece(named, record)` (collective; every rank gets the same answer): each rank
  hashes its own share of each tensor as it holds it now, restricted to each recorded piece
  (lanes add up over any partition, so the layout may differ from the one recorded: W = 4
  FSDP2 pieces checked at W = 2), and the shares' lanes go to the ranks of the tensor's mesh
  (16 bytes and a count per piece per rank). A recorded piece whose lanes its readers'
  shares do not add up to, or whose elements they do not cover exactly once, is reported with
  its index runs, the ranks that held it when recorded and the ranks that read it now; dtype
  and shape are checked too. No tensor is gathered.
- A GPU rank's lanes stay on its device until the exchange (audit/exchange.py `stacked`,
  `read`): each call reads the device once per mesh, not once per tensor or piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from titan_audit.audit import exchange, pieces, shards
from titan_audit.audit.fingerprint import fingerprint, lattice_digest, whole_hash_bytes
from titan_audit.batch_invariant.cpu import lattice


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _Held:
    """What this rank holds of one tensor: its group, piece and share (module doc)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtensor = pieces.is_dtensor(tensor)
        if self.dtensor:
            tensor = exchange.reduced(tensor)
            self.group, self.ranks = exchange.group_of(tensor.device_mesh)
            self.local = tensor.to_local()
            self.part, self.parts = pieces.replica(tensor)
        else:
            world = dist.get_world_size() if _distributed() else 1
            self.group, self.ranks = None, list(range(world))
            self.local = tensor.detach()
            self.part, self.parts = (dist.get_rank(), world) if _distributed() else (0, 1)
        self.tensor = tensor
        self.piece = pieces.piece_of(tensor)

    def share(self) -> tuple[torch.Tensor, pieces.Piece] | None:
        return pieces.share_of(self.local, self.piece, self.part, self.parts)

    def held_by(self, rank: int) -> tuple[pieces.Piece, int, int]:
        """(piece, part, parts) of group rank `rank`."""
        if not self.dtensor:
            return self.piece, self.ranks.index(rank), len(self.ranks)
        coord = pieces.coordinate(self.tensor.device_mesh, rank)
        return (pieces.piece_of(self.tensor, coord), *pieces.replica(self.tensor, coord))


def _by_group(held: Sequence[_Held]) -> dict[tuple[int, ...], list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, h in enumerate(held):
        groups.setdefault(tuple(h.ranks), []).append(i)
    return groups


def _hex(lanes: tuple[int, int]) -> str:
    return f"{lanes[0]:016x}{lanes[1]:016x}"


def _unsigned_pair(row: torch.Tensor) -> tuple[int, int]:
    return int(row[0]) & lattice.MASK, int(row[1]) & lattice.MASK


def _unhex(text: str) -> tuple[int, int]:
    if not isinstance(text, str) or len(text) != 32:
        raise ValueError(f"piece lanes must be 32 hex digits, got {text!r}")
    return int(text[:16], 16), int(text[16:], 16)


def digests_by_piece(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any] | None:
    """{"tensors": {name: fingerprint}, "pieces": {name: [{"index", "lanes", "ranks"}]}} on rank
    0, None on the others (module doc). Collective: every rank, the same names in one order."""
    held = [_Held(t) for _, t in named]
    me = dist.get_rank() if _distributed() else 0
    pieces: dict[str, list[dict[str, Any]]] = {}
    totals: dict[str, tuple[int, int]] = {}
    for ranks, members in _by_group(held).items():
        if 0 not in ranks:
            continue  # replicas of what rank 0's groups hold
        rows = []
        for i in members:
            picked = held[i].share()
            rows.append(shards.sums(*picked) if picked else torch.zeros(2, dtype=torch.int64))
        group = held[members[0]].group
        gathered = exchange.gather(exchange.stacked(rows, group, ranks), group, ranks, 0)
        if gathered is None:
            continue
        gathered = exchange.read(gathered)
        for k, i in enumerate(members):
            by_key: dict[str, dict[str, Any]] = {}
            runs_of: dict[int, list] = {}  # a replicated piece is one object on every rank
            for j, rank in enumerate(ranks):
                piece, _, _ = held[i].held_by(rank)
                runs = runs_of.get(id(piece))
                if runs is None:
                    runs = runs_of[id(piece)] = piece.runs()
                entry = by_key.setdefault(repr(runs), {"index": runs, "lanes": (0, 0), "ranks": []})
                share = _unsigned_pair(gathered[j][k])
                entry["lanes"] = lattice.add_lanes([entry["lanes"], share])
                entry["ranks"].append(rank)
            name = named[i][0]
            totals[name] = lattice.add_lanes([e["lanes"] for e in by_key.values()])
            pieces[name] = [{**e, "lanes": _hex(e["lanes"])} for e in by_key.values()]
    digests = _fingerprints(named, held, totals, me)
    if me != 0:
        return None
    meta = {name: _meta(tensor) for name, tensor in named}
    return {"tensors": digests, "meta": dict(sorted(meta.items())), "pieces": dict(sorted(pieces.items()))}


def _fingerprints(
    named: Sequence[tuple[str, torch.Tensor]], held: Sequence[_Held], totals: dict[str, tuple[int, int]], me: int
) -> dict[str, str]:
    """Rank 0: each tensor's fingerprint; above C from the pieces' lanes, at most C hashed whole
    (a small DTensor's pieces gathered to rank 0 in one exchange per mesh)."""
    limit = whole_hash_bytes()
    small = [(name, h) for (name, _), h in zip(named, held) if h.tensor.numel() * h.tensor.element_size() <= limit]
    gathered = exchange.combine(
        [(h.tensor, False, 0) for _, h in small if h.dtensor], whole_bytes=limit, partial_stats=None
    )
    full = iter(gathered)
    out: dict[str, str] = {}
    for name, h in small:
        combined = next(full) if h.dtensor else None
        if me == 0:
            out[name] = fingerprint(combined.full if h.dtensor else h.tensor)
    if me == 0:
        for (name, _), h in zip(named, held):
            if name not in out:
                out[name] = lattice_digest(h.tensor.dtype, tuple(h.tensor.shape), totals[name])
    return dict(sorted(out.items()))


def verify_by_piece(named: Sequence[tuple[str, torch.Tensor]], record: dict[str, Any], where: str) -> list[str]:
    """Problems (empty: verified), the same sorted lines on every rank, each starting with
    "<tensor name>: " (module doc). `record` is what `digests_by_piece` returned; `where` names
    the record in the lines. Collective."""
    problems: list[str] = []
    names = {name for name, _ in named}
    for name in sorted(set(record["tensors"]) ^ names):
        problems.append(f"{name}: {'not in ' + where if name in names else 'in ' + where + ' but not here'}")
    held, expected = [], []
    for name, tensor in named:
        if name not in record["tensors"]:
            continue
        pieces = record.get("pieces", {}).get(name)
        described = record.get("meta", {}).get(name)
        if not isinstance(pieces, list) or not pieces:
            problems.append(f"{name}: no pieces in {where}")
        elif described != _meta(tensor):
            problems.append(f"{name}: {_meta(tensor)} here, {described} in {where}")
        else:
            held.append((name, _Held(tensor)))
            expected.append(pieces)
    for verdict in _piece_checks(held, expected, record["tensors"]):
        problems.extend(verdict)
    if _distributed():
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, problems)
        problems = sorted({p for rank_problems in everyone for p in rank_problems})
    return problems


def _meta(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _piece_rows(h: _Held, stored: list[pieces.Piece]) -> list[torch.Tensor]:
    """This rank's (lanes, element count) of its share within each stored piece, as int64 [3]
    on the device that hashed it (not read) or the host."""
    picked = h.share()
    rows = []
    for piece in stored:
        positions = None if picked is None else picked[1].positions_in(piece)
        count = 0 if positions is None else math.prod(len(p) for p in positions)
        if not count:
            rows.append(torch.zeros(3, dtype=torch.int64))
            continue
        lanes = shards.sums(picked[0], picked[1], positions)
        rows.append(torch.cat([lanes, torch.full((1,), count, dtype=torch.int64, device=lanes.device)]))
    return rows


def _piece_checks(
    held: Sequence[tuple[str, _Held]], expected: Sequence[list[dict]], digests: dict[str, str]
) -> list[list[str]]:
    """Per tensor, its problems, from one exchange per mesh of every rank's share of each piece."""
    out: list[list[str]] = [[] for _ in held]
    limit = whole_hash_bytes()
    for ranks, members in _by_group([h for _, h in held]).items():
        stored = {
            i: [pieces.Piece.from_runs(held[i][1].tensor.shape, p["index"]) for p in expected[i]] for i in members
        }
        rows = [row for i in members for row in _piece_rows(held[i][1], stored[i])]
        group = held[members[0]][1].group
        gathered = exchange.read(exchange.gather(exchange.stacked(rows, group, ranks), group, ranks, None))
        at = 0
        for i in members:
            name, h = held[i]
            total = []
            for piece, entry in zip(stored[i], expected[i]):
                parts = [g[at] for g in gathered]
                at += 1
                lanes = lattice.add_lanes([_unsigned_pair(p) for p in parts])
                total.append(lanes)
                count = sum(int(p[2]) for p in parts)
                if lanes != _unhex(entry["lanes"]) or count != piece.numel:
                    readers = [r for r, p in zip(ranks, parts) if int(p[2])]
                    out[i].append(
                        f"{name}: piece {_describe(entry['index'])} (held by rank(s) {entry.get('ranks')} when "
                        f"saved) differs as read by rank(s) {readers}"
                        + ("" if count == piece.numel else f" ({count} of its {piece.numel} elements read)")
                    )
            t = h.tensor
            if t.numel() * t.element_size() > limit and not out[i]:
                if lattice_digest(t.dtype, tuple(t.shape), lattice.add_lanes(total)) != digests[name]:
                    out[i].append(f"{name}: its pieces do not add up to its digest")
    return out


def _describe(runs: list) -> str:
    return " x ".join("+".join(f"[{a}, {b})" for a, b in dim) or "[]" for dim in runs) or "(0-d)"
