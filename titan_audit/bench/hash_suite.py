"""`bench hash`: tensor fingerprint time against a plain memory copy of the same tensors, and the
two designs of a digest that ranks can compute over their own pieces.

`fingerprint <size>` cases (tensors of at most C = 2 MiB: audit.fingerprint's xxh3-128):
baseline `dst.copy_(src)` into a preallocated tensor (a memory copy through torch, the cheapest
way to touch the same bytes from Python), candidate `audit.fingerprint`; second baseline, as
the extra key `sha256_s`: `hashlib.sha256` over the same bytes (what TorchTitan's tests hash
with). Target: fingerprint <= 2x the copy, i.e. hashing at >= 50% of copy bandwidth.

`sharded digest <size>` cases (above C): baseline the whole-tensor xxh3-128 (one rank, all the
bytes, in order), candidate the lattice digest audit.fingerprint uses above C (our compiled
kernel, one thread); extra keys: `chunked_xxh3_s` (the other design: xxh3-128 of fixed 1 MiB
chunks of the row-major bytes, chunk digests combined in order), `lattice_numpy_s` (the lattice
in vectorised numpy: what the kernel is measured against, at the smaller sizes only),
`lattice_threads_s` (the kernel on every intra-op thread; the sum does not depend on the split),
and what each design must move between ranks to hash the tensor, in bytes, when it is sharded
over 4 ranks as FSDP2 does (dim 0, torch.chunk) and as a row-wise TP shard (dim 1):
`*_bytes_moved_fsdp4`, `*_bytes_moved_tp4_dim1`. Chunked xxh3 needs every chunk's bytes on one
rank: a chunk that straddles two ranks' pieces moves, and under a dim-1 shard every chunk does
(nearly a gather); the lattice moves 16 bytes per rank. No target: the figures choose a design.

The fingerprint cases run on one thread (xxh3 is sequential), so the ratio compares like with
like and an overloaded machine cannot stall one side's OpenMP team.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from titan_audit.audit import pieces, shards
from titan_audit.audit.fingerprint import fingerprint, fingerprint_many, whole_digest
from titan_audit.batch_invariant.cpu import lattice
from titan_audit.bench.core import BenchOptions, Case, compare

TARGET_RATIO = 2.0
SIZES = [4 << 10, 64 << 10, 1 << 20, 2 << 20]  # up to C: the xxh3 fingerprint
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]
SHARDED_SIZES = [16 << 20, 256 << 20]
QUICK_SHARDED_SIZES = [4 << 20]
NUMPY_MAX_BYTES = 16 << 20  # the numpy lattice above this takes seconds a call
CHUNK = 1 << 20  # chunked xxh3's chunk
RANKS = 4
LANES_BYTES = 16


def _label(nbytes: int) -> str:
    for unit, shift in (("MB", 20), ("KB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


def _state_dict(count: int) -> dict[str, torch.Tensor]:
    """A model-like state dict: `count` float32 tensors of 1 KB to 64 KB, sizes from a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    numels = torch.randint(256, 16384, (count,), generator=generator).tolist()
    return {f"layers.{i}.weight": torch.randn(n, generator=generator) for i, n in enumerate(numels)}


def _sha256(tensors: list[torch.Tensor]) -> Callable[[], object]:
    buffers = [t.view(-1).view(torch.uint8).numpy() for t in tensors]
    return lambda: [hashlib.sha256(b).digest() for b in buffers]


def hash_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = _cases(options, progress)
    finally:
        torch.set_num_threads(threads)
    return cases + _sharded_cases(options, progress, threads)


def _chunked_xxh3(tensor: torch.Tensor) -> str:
    """The other design: xxh3-128 of each CHUNK bytes of the row-major bytes, combined in order."""
    raw = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    digests = b"".join(xxhash.xxh3_128_digest(raw[i : i + CHUNK]) for i in range(0, len(raw), CHUNK))
    return xxhash.xxh3_128_hexdigest(digests)


def _lattice_numpy(tensor: torch.Tensor) -> tuple[int, int]:
    words = tensor.view(-1).view(torch.int32).numpy().view(np.uint32)
    return lattice.reference_lanes(words, np.arange(words.size, dtype=np.uint64))


def _chunked_bytes_moved(rows: int, cols: int, itemsize: int, dim: int) -> int:
    """Bytes chunked xxh3 must move to hash a [rows, cols] tensor sharded over RANKS on `dim`
    (torch.chunk pieces): every chunk that is not wholly on one rank goes to one of them, which
    receives the chunk's bytes the other ranks hold."""
    nbytes = rows * cols * itemsize
    size = -(-(rows if dim == 0 else cols) // RANKS)
    bounds = [min(k * size, rows if dim == 0 else cols) for k in range(RANKS + 1)]
    if dim == 1:  # every row is split at the same columns: a chunk holds pieces of every rank
        owner_share = max(b - a for a, b in zip(bounds, bounds[1:])) / cols
        return int(nbytes * (1 - owner_share)) if CHUNK < nbytes else nbytes
    moved = 0
    for cut in bounds[1:-1]:  # a dim-0 cut inside a chunk: the smaller side moves
        at = cut * cols * itemsize
        inside = at % CHUNK
        if inside:
            moved += min(inside, CHUNK - inside)
    return moved


def _sharded_cases(options: BenchOptions, progress: Callable[[str], None], threads: int) -> list[Case]:
    cases = []
    for nbytes in QUICK_SHARDED_SIZES if options.quick else SHARDED_SIZES:
        cols = 4096
        src = torch.randn(nbytes // 4 // cols + 1, cols)  # one row more: FSDP2's chunks are uneven
        piece = pieces.Piece.whole(src.shape)
        others = {
            "chunked_xxh3": lambda: _chunked_xxh3(src),
            "lattice_threads": lambda: shards.lanes(src, piece, threads=threads),
        }
        if nbytes <= NUMPY_MAX_BYTES:
            others["lattice_numpy"] = lambda: _lattice_numpy(src)
        name = f"sharded digest {_label(nbytes)}"
        case = compare(
            name,
            ("xxh3-128 whole tensor", lambda: whole_digest(src)),
            ("lattice digest (kernel, 1 thread)", lambda: shards.lanes(src, piece, threads=1)),
            options,
            others=others,
        )
        rows = src.shape[0]
        case.extra["threads"] = threads
        case.extra["lattice_gb_per_s"] = nbytes / case.candidate_s / 1e9
        case.extra["xxh3_gb_per_s"] = nbytes / case.baseline_s / 1e9
        case.extra["bytes"] = src.nbytes
        case.extra["chunked_xxh3_bytes_moved_fsdp4"] = _chunked_bytes_moved(rows, cols, 4, 0)
        case.extra["chunked_xxh3_bytes_moved_tp4_dim1"] = _chunked_bytes_moved(rows, cols, 4, 1)
        case.extra["lattice_bytes_moved_fsdp4"] = case.extra["lattice_bytes_moved_tp4_dim1"] = (RANKS - 1) * LANES_BYTES
        cases.append(case)
        progress(name)
    return cases


def _cases(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    cases = []
    for nbytes in QUICK_SIZES if options.quick else SIZES:
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        name = f"fingerprint {_label(nbytes)}"
        case = compare(
            name,
            ("Tensor.copy_", lambda: dst.copy_(src)),
            ("xxh3-128 fingerprint", lambda: fingerprint(src)),
            options,
            target=TARGET_RATIO,
            others={"sha256": _sha256([src])},
        )
        case.extra["fingerprint_gb_per_s"] = nbytes / case.candidate_s / 1e9
        cases.append(case)
        progress(name)

    count = 64 if options.quick else 2048
    state = _state_dict(count)
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    pairs = [(copies[k], v) for k, v in state.items()]
    name = f"fingerprint_many state_dict tensors={count}"
    case = compare(
        name,
        ("Tensor.copy_ per tensor", lambda: [d.copy_(s) for d, s in pairs]),
        ("xxh3-128 fingerprint_many", lambda: fingerprint_many(state)),
        options,
        target=TARGET_RATIO,
        others={"sha256": _sha256(list(state.values()))},
    )
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    case.extra["bytes"] = nbytes
    case.extra["tensors_per_s"] = count / case.candidate_s
    cases.append(case)
    progress(name)
    return cases
