"""Built-in data for demos and tests: a synthetic task corpus as Parquet plus its byte-level token store.

`prepare_synthetic(out_dir, config)` writes `<out_dir>/tasks.parquet` (synthetic.py) and tokenizes
it with the byte-level tokenizer into `<out_dir>/tasks.zarr` (prepare.py), so the real Parquet
and prepare paths are exercised. Both are pure functions of `config`; existing outputs are refused
unless `overwrite=True`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from titan_audit.data.prepare import PrepareConfig, prepare
from titan_audit.data.synthetic import SyntheticConfig, write_synthetic_parquet


@dataclass(frozen=True)
class BuiltinData:
    parquet: Path
    store: Path


def prepare_synthetic(
    out_dir: str | os.PathLike, config: SyntheticConfig, *, workers: int = 0, overwrite: bool = False
) -> BuiltinData:
    out_dir = Path(out_dir)
    parquet = write_synthetic_parquet(out_dir / "tasks.parquet", config, overwrite=overwrite)
    store = out_dir / "tasks.zarr"
    prepare(PrepareConfig(sources=(str(parquet),), out=str(store), workers=workers, overwrite=overwrite))
    return BuiltinData(parquet, store)
