"""Shared fixtures for data/ tests: a small synthetic Parquet corpus and its byte-level token store."""

from pathlib import Path

import pytest

from titan_audit.data import PrepareConfig, SyntheticConfig, prepare, write_synthetic_parquet


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tasks.parquet"
    write_synthetic_parquet(path, SyntheticConfig(num_records=3000, seed=7, row_group_size=400))
    return path


@pytest.fixture(scope="session")
def store(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "tasks.zarr"
    prepare(PrepareConfig(sources=(str(corpus),), out=str(out)))
    return out
