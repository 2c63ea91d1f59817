"""`bench data`: the elastic loader against a plain `torch.utils.data.DataLoader` and torchdata's
`StatefulDataLoader`, over the same pre-tokenized data with the same number of workers.

Data: a token store of random documents (vocab 32000, lengths 64..1536, fixed seed), written to a
temporary directory. Work per microbatch: M = 8 sequences of L = 1024 tokens with targets.
Baseline: a map-style Dataset whose item j is the window tokens[j*L : j*L + L + 1] of the store's
zarr token array (one zarr slice per item), a seeded RandomSampler, default collation, inputs and
targets split from the window, `num_workers` worker processes. Second baseline, as the extra key
`stateful_dataloader_s`: the same with torchdata's StatefulDataLoader (skipped with a note when
torchdata is not installed). Candidate: ElasticLoader (concat packing, which adds EOS, doc ids,
positions, loss mask and the global token count) at W = 1 with the same worker count (threads).
Each side keeps one iterator; time per microbatch is the minimum over `repeats` interleaved
batches of K microbatches, after a warm-up. Target: ratio <= 1.0 (at least the plain loader's
throughput). Tokens/s figures are extra keys.

Resume: time to first microbatch (construct the loader from a saved state, then take one
microbatch) at global step 1,000,000 (candidate) against step 10 (baseline), min over repeats.
Target: <= 1.5.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
import zarr

from titan_audit.bench.core import BenchOptions, Case
from titan_audit.data import ElasticLoader, LoaderConfig, write_token_store

SEQ_LEN, MICROBATCH, GLOBAL_BATCH = 1024, 8, 64
THROUGHPUT_TARGET, RESUME_TARGET = 1.0, 1.5
FAR_STEP, NEAR_STEP = 1_000_000, 10


def _make_store(path: str, num_tokens: int) -> None:
    rng = np.random.default_rng(0)
    docs, total = [], 0
    while total < num_tokens:
        n = int(rng.integers(64, 1537))
        docs.append(rng.integers(0, 32000, size=n, dtype=np.uint32))
        total += n
    write_token_store(path, docs, vocab_size=32002, eos_id=32000, pad_id=32001, tokenizer="bench-random")


class _Windows(torch.utils.data.Dataset):
    """The plain way: item j = tokens[j*L : j*L + L + 1] read from the zarr array."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.array = None
        self.length = (zarr.open_array(f"{store}/tokens", mode="r").shape[0] - 1) // SEQ_LEN

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, j: int) -> torch.Tensor:
        if self.array is None:  # opened lazily, once per worker process
            self.array = zarr.open_array(f"{self.store}/tokens", mode="r")
        return torch.from_numpy(self.array[j * SEQ_LEN : j * SEQ_LEN + SEQ_LEN + 1].astype(np.int64))


def _forever(make: Callable[[], Iterator]) -> Iterator:
    while True:
        yield from make()


def _plain_iter(loader_cls, dataset: _Windows, workers: int) -> Iterator:
    loader = loader_cls(
        dataset,
        batch_size=MICROBATCH,
        sampler=torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )

    def consume() -> Iterator:
        for window in loader:
            yield window[:, :-1], window[:, 1:]

    return _forever(consume)


def _timer(it: Iterator, count: int) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for _ in range(count):
            next(it)
        return (time.perf_counter() - start) / count

    return run


def _throughput_case(store: str, workers: int, count: int, options: BenchOptions) -> Case:
    config = LoaderConfig(
        store=store,
        seq_len=SEQ_LEN,
        global_batch_size=GLOBAL_BATCH,
        microbatch_size=MICROBATCH,
        workers=workers,
        prefetch=max(4, 2 * workers),
    )
    elastic = ElasticLoader(config, rank=0, world_size=1)
    sides: dict[str, Callable[[], float]] = {
        "plain": _timer(_plain_iter(torch.utils.data.DataLoader, _Windows(store), workers), count),
        "elastic": _timer(iter(elastic), count),
    }
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader

        sides["stateful"] = _timer(_plain_iter(StatefulDataLoader, _Windows(store), workers), count)
    except ImportError:
        StatefulDataLoader = None  # noqa: N806
    try:
        for timer in sides.values():  # warm up: start workers, fill caches and queues
            timer()
        best = {name: float("inf") for name in sides}
        for _ in range(options.repeats):
            for name, timer in sides.items():
                best[name] = min(best[name], timer())
    finally:
        elastic.close()
    tokens = MICROBATCH * SEQ_LEN
    extra: dict = {
        "workers": workers,
        "plain_tokens_per_s": tokens / best["plain"],
        "elastic_tokens_per_s": tokens / best["elastic"],
    }
    if "stateful" in best:
        extra["stateful_dataloader_s"] = best["stateful"]
        extra["stateful_tokens_per_s"] = tokens / best["stateful"]
        extra["ratio_vs_stateful"] = best["elastic"] / best["stateful"]
    else:
        extra["stateful_dataloader_s"] = None
        extra["note"] = "torchdata not installed: StatefulDataLoader not measured"
    return Case(
        f"tokens/s workers={workers} (M={MICROBATCH}, L={SEQ_LEN})",
        "torch DataLoader",
        "ElasticLoader",
        best["plain"],
        best["elastic"],
        best["elastic"] / best["plain"],
        THROUGHPUT_TARGET,
        extra,
    )


def _resume_case(store: str, options: BenchOptions) -> Case:
    config = LoaderConfig(store=store, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, microbatch_size=MICROBATCH)
    states = {}
    with ElasticLoader(config, rank=0, world_size=1) as probe:
        for step in (NEAR_STEP, FAR_STEP):
            probe.seek(step)
            states[step] = probe.state()

    def first_batch(step: int) -> float:
        start = time.perf_counter()
        with ElasticLoader(config, rank=0, world_size=1, state=states[step]) as loader:
            next(iter(loader))
        return time.perf_counter() - start

    first_batch(NEAR_STEP), first_batch(FAR_STEP)  # warm the file cache
    best = {NEAR_STEP: float("inf"), FAR_STEP: float("inf")}
    for _ in range(max(3, options.repeats)):
        for step in best:
            best[step] = min(best[step], first_batch(step))
    return Case(
        f"resume: time to first batch at step {FAR_STEP:.0e} vs {NEAR_STEP}",
        f"resume at step {NEAR_STEP}",
        f"resume at step {FAR_STEP}",
        best[NEAR_STEP],
        best[FAR_STEP],
        best[FAR_STEP] / best[NEAR_STEP],
        RESUME_TARGET,
        {"epoch_at_far_step": states[FAR_STEP].epoch},
    )


def data_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on every iterator
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return _data_suite(options, progress)


def _data_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    num_tokens = (2 << 20) if options.quick else (32 << 20)
    count = 8 if options.quick else 64
    with tempfile.TemporaryDirectory(prefix="titan-bench-data-") as tmp:
        store = f"{tmp}/tokens.zarr"
        _make_store(store, num_tokens)
        progress("store")
        cases = []
        for workers in (0,) if options.quick else (0, 2):
            cases.append(_throughput_case(store, workers, count, options))
            progress(cases[-1].case)
        cases.append(_resume_case(store, options))
        progress(cases[-1].case)
    return cases
