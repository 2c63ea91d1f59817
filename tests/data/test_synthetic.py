"""Synthetic verifiable-task corpora: seeded, per-record independent, answers verifiable from prompts."""

import pyarrow.parquet as pq
import pytest

from titan_audit.data import SyntheticConfig, is_correct, make_record, solve, write_synthetic_parquet
from titan_audit.data.synthetic import TASKS


def test_records_are_verifiable_and_cover_every_task():
    records = [make_record(0, i) for i in range(300)]
    assert {r.task for r in records} == set(TASKS)
    for r in records:
        assert solve(r.task, r.prompt) == r.answer
        assert is_correct(r.task, r.prompt, f"  {r.answer}\n")
        assert r.text == f"{r.prompt} {r.answer}"
    wrong = records[0]
    assert not is_correct(wrong.task, wrong.prompt, wrong.answer + "0")  # negative control


def test_parquet_is_a_function_of_the_seed(tmp_path):
    a = write_synthetic_parquet(tmp_path / "a.parquet", SyntheticConfig(500, seed=1, row_group_size=64))
    b = write_synthetic_parquet(tmp_path / "b.parquet", SyntheticConfig(500, seed=1, row_group_size=64))
    c = write_synthetic_parquet(tmp_path / "c.parquet", SyntheticConfig(500, seed=2, row_group_size=64))
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()  # negative control
    meta = pq.ParquetFile(a).metadata
    assert meta.num_row_groups == 8 and meta.num_rows == 500
    table = pq.read_table(a)
    assert table.column_names == ["id", "task", "prompt", "answer", "text"]
    # record i does not depend on how many records were generated
    small = pq.read_table(write_synthetic_parquet(tmp_path / "s.parquet", SyntheticConfig(10, seed=1)))
    assert small.to_pylist() == table.slice(0, 10).to_pylist()
    with pytest.raises(ValueError, match="already exists"):
        write_synthetic_parquet(tmp_path / "a.parquet", SyntheticConfig(5, seed=1))


def test_task_subset_and_bad_config():
    assert {make_record(0, i, ("sorting",)).task for i in range(20)} == {"sorting"}
    with pytest.raises(ValueError, match="unknown task"):
        SyntheticConfig(10, tasks=("poetry",))
    with pytest.raises(ValueError, match="num_records must be >= 1, got 0"):
        SyntheticConfig(0)
    with pytest.raises(ValueError, match="not a sorting prompt"):
        solve("sorting", "Compute: 1 + 1 =")


def test_prepare_synthetic_builds_parquet_and_store(tmp_path):
    from titan_audit.data import ByteTokenizer, ElasticLoader, LoaderConfig, TokenStore, prepare_synthetic

    built = prepare_synthetic(tmp_path, SyntheticConfig(200, seed=5, row_group_size=50))
    store = TokenStore(built.store)
    assert store.num_docs == 200 and store.origin.entries[0].name == "tasks.parquet"
    assert ByteTokenizer().decode(store.doc(17)) == make_record(5, 17).text
    with ElasticLoader(
        LoaderConfig(store=str(built.store), seq_len=32, global_batch_size=4, microbatch_size=2)
    ) as loader:
        assert next(iter(loader)).tokens.shape == (2, 32)
    with pytest.raises(ValueError, match="already exists"):
        prepare_synthetic(tmp_path, SyntheticConfig(200, seed=5))
