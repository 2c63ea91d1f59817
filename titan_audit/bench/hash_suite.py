"""`bench hash`: tensor fingerprint time against a plain memory copy of the same tensors.

Baseline: `dst.copy_(src)` into a preallocated tensor (a memory copy through torch, the cheapest
way to touch the same bytes from Python). Candidate: `audit.fingerprint`. Second baseline, as
the extra key `sha256_s`: `hashlib.sha256` over the same bytes (what TorchTitan's tests hash with).
Target: fingerprint <= 2x the copy, i.e. hashing at >= 50% of copy bandwidth.

Both sides run on one thread (the fingerprint is single-threaded by design: xxh3 is sequential),
so the ratio compares like with like and an overloaded machine cannot stall one side's
OpenMP team.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from titan_audit.audit.fingerprint import fingerprint, fingerprint_many
from titan_audit.bench.core import BenchOptions, Case, compare

TARGET_RATIO = 2.0
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20]


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
        return _cases(options, progress)
    finally:
        torch.set_num_threads(threads)


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
