"""`prepare`: tokenize a text source once into a zarr token store, in parallel, deterministically.

Guarantees: the store's bytes depend only on the source files and the tokenizer, never on the
worker count. Work units (Parquet row groups, JSONL line-aligned byte ranges) are tokenized by a
pool of `workers` processes (0 = in this process) and their results are written strictly in unit
order (`Executor.map` yields in submission order), at most `workers * 2` units in flight. The
output appears atomically (temporary directory, then rename); an existing output is refused
unless `overwrite=True`. The output's lock is held throughout (`store_output_lock`): a second
`prepare` of the same output is refused at once, and the `.NAME.XXXX.tmp` directories a killed
`prepare` left are removed first (an INFO log line names each). A refused prepare creates
nothing (not even the output's parent directory). Progress (documents tokenized)
is shown with tqdm when `progress=True`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from titan_audit.atomic import atomic_output_dir
from titan_audit.data.sources import TextSource, WorkUnit, open_text_source, read_unit
from titan_audit.data.token_store import StoreInfo, TokenStore, TokenStoreWriter, store_output_lock
from titan_audit.data.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class PrepareConfig:
    sources: tuple[str, ...]
    out: str
    text_column: str = "text"
    tokenizer: TokenizerSpec = TokenizerSpec()
    workers: int = 0
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")


_worker_tokenizer = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = spec.build()


def _tokenize_unit(unit: WorkUnit, text_column: str) -> list[np.ndarray]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(read_unit(unit, text_column))


def _results(source: TextSource, units: list[WorkUnit], config: PrepareConfig) -> Iterator[list[np.ndarray]]:
    if config.workers == 0:
        _init_worker(config.tokenizer)
        for unit in units:
            yield _tokenize_unit(unit, source.text_column)
        return
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
    with ProcessPoolExecutor(
        config.workers, mp_context=context, initializer=_init_worker, initargs=(config.tokenizer,)
    ) as pool:
        window = config.workers * 2
        pending = []
        index = 0
        while index < len(units) or pending:
            while index < len(units) and len(pending) < window:
                pending.append(pool.submit(_tokenize_unit, units[index], source.text_column))
                index += 1
            yield pending.pop(0).result()


def prepare(config: PrepareConfig, *, progress: bool = False) -> StoreInfo:
    """Tokenize `config.sources` into the token store `config.out`; returns the store's info."""
    if Path(config.out).parent.is_dir():  # lock first: even a refused prepare removes what a killed one left
        with store_output_lock(config.out):
            return _prepare(config, progress=progress, locked=True)
    return _prepare(config, progress=progress, locked=False)  # nothing can be left where nothing is yet


def _prepare(config: PrepareConfig, *, progress: bool, locked: bool) -> StoreInfo:
    out = Path(config.out)
    if out.exists() and not config.overwrite:
        raise ValueError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    source = open_text_source(list(config.sources), config.text_column)
    tokenizer = config.tokenizer.build()
    manifest = source.manifest()
    manifest = type(manifest)(
        manifest.kind, manifest.entries, extra={**manifest.extra, "tokenizer": tokenizer.identity}
    )
    units = source.units()
    with (
        contextlib.nullcontext() if locked else store_output_lock(out),
        atomic_output_dir(out, overwrite=config.overwrite) as tmp,
    ):
        writer = TokenStoreWriter(
            tmp,
            tokenizer=tokenizer.identity,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            origin=manifest,
        )
        # No tqdm at all when quiet: even a disabled bar creates tqdm's process-shared lock, a
        # semaphore that rank processes (which leave by os._exit) would leak.
        bar = tqdm(total=manifest.total_rows, unit="doc", desc=f"prepare {out.name}") if progress else None
        with bar if bar is not None else contextlib.nullcontext():
            for docs in _results(source, units, config):
                writer.append(docs)
                if bar is not None:
                    bar.update(len(docs))
        writer.close()
        if writer.num_docs != manifest.total_rows:
            raise ValueError(
                f"read {writer.num_docs} documents but the source manifest counts {manifest.total_rows} rows"
            )
    return TokenStore(out).info
