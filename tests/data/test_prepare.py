"""`prepare`: same store bytes whatever the worker count; atomic output; corrupt stores named."""

import json
import os

import numpy as np
import pytest

from titan_audit.data import (
    ByteTokenizer,
    PrepareConfig,
    SyntheticConfig,
    TokenStore,
    prepare,
    store_manifest,
    write_synthetic_parquet,
)
from titan_audit.data import sources as sources_module
from titan_audit.data.synthetic import make_record


def test_store_holds_the_documents_in_source_order(store):
    opened = TokenStore(store)
    tok = ByteTokenizer()
    assert opened.num_docs == 3000
    for i in (0, 1, 399, 400, 2999):  # across row-group boundaries
        assert tok.decode(opened.doc(i)) == make_record(7, i).text
    assert opened.origin.entries[0].rows == 3000


def test_worker_count_does_not_change_the_bytes(tmp_path, corpus):
    digests = {}
    for workers in (0, 1, 3):
        out = tmp_path / f"w{workers}.zarr"
        prepare(PrepareConfig(sources=(str(corpus),), out=str(out), workers=workers))
        manifest = store_manifest(out)
        digests[workers] = manifest.digest()
    assert len(set(digests.values())) == 1, digests  # every file of the store, byte for byte
    # negative control: a different corpus (another seed) gives another store
    other = write_synthetic_parquet(tmp_path / "other.parquet", SyntheticConfig(3000, seed=8, row_group_size=400))
    prepare(PrepareConfig(sources=(str(other),), out=str(tmp_path / "other.zarr")))
    assert store_manifest(tmp_path / "other.zarr").digest() != digests[0]


def test_jsonl_source_in_many_units_with_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "JSONL_SPLIT_BYTES", 2000)  # units are cut in this process
    path = tmp_path / "a.jsonl"
    texts = [make_record(1, i).text for i in range(700)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(PrepareConfig(sources=(str(path),), out=str(tmp_path / "a.zarr"), workers=2))
    prepare(PrepareConfig(sources=(str(path),), out=str(tmp_path / "b.zarr"), workers=0))
    assert store_manifest(tmp_path / "a.zarr").digest() == store_manifest(tmp_path / "b.zarr").digest()
    store = TokenStore(tmp_path / "a.zarr")
    assert [ByteTokenizer().decode(store.doc(i)) for i in (0, 350, 699)] == [texts[0], texts[350], texts[699]]


def test_existing_output_is_refused_and_overwrite_is_atomic(tmp_path, corpus):
    out = tmp_path / "s.zarr"
    prepare(PrepareConfig(sources=(str(corpus),), out=str(out)))
    with pytest.raises(ValueError, match=r"s\.zarr already exists; pass overwrite=True"):
        prepare(PrepareConfig(sources=(str(corpus),), out=str(out)))
    prepare(PrepareConfig(sources=(str(corpus),), out=str(out), overwrite=True))
    assert sorted(os.listdir(tmp_path)) == ["s.zarr"]  # no temporary directory left behind
    # a failed prepare leaves nothing behind either
    with pytest.raises(ValueError, match="no text column"):
        prepare(PrepareConfig(sources=(str(corpus),), out=str(tmp_path / "t.zarr"), text_column="body"))
    assert sorted(os.listdir(tmp_path)) == ["s.zarr"]


def test_corrupt_stores_are_named(tmp_path, corpus, store):
    import shutil

    with pytest.raises(ValueError, match=r"nothing\.zarr: not a token store"):
        TokenStore(tmp_path / "nothing.zarr")
    bad = tmp_path / "bad.zarr"
    shutil.copytree(store, bad)
    (bad / "offsets" / "zarr.json").unlink()
    with pytest.raises(ValueError, match=r"bad\.zarr: missing or corrupt array 'offsets'"):
        TokenStore(bad)
    shutil.rmtree(bad)
    shutil.copytree(store, bad)
    meta = json.loads((bad / "zarr.json").read_text())
    meta["attributes"]["num_tokens"] += 1
    (bad / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"bad\.zarr: 'tokens' has \d+ entries, attribute num_tokens says"):
        TokenStore(bad)
    shutil.rmtree(bad)
    shutil.copytree(store, bad)
    (bad / "zarr.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.zarr: corrupt zarr store"):
        TokenStore(bad)
    np.testing.assert_equal(TokenStore(store).doc(5), TokenStore(store).doc(5))  # the original is intact


@pytest.mark.parametrize("vocab", [300, 70_000])  # uint16 and uint32 stores
def test_direct_chunk_reads_equal_zarr_reads(tmp_path, vocab):
    from titan_audit.data import write_token_store
    from titan_audit.data.token_store import CHUNK_TOKENS

    rng = np.random.default_rng(vocab)
    docs = [rng.integers(0, vocab - 2, size=n).astype(np.uint32) for n in rng.integers(1, 5000, size=60)]
    docs.append(np.zeros(CHUNK_TOKENS * 2, dtype=np.uint32))  # an all-zero chunk: zarr does not write its file
    write_token_store(tmp_path / "s.zarr", docs, vocab_size=vocab, eos_id=vocab - 2, pad_id=vocab - 1)
    store = TokenStore(tmp_path / "s.zarr")
    assert store._direct is not None  # the fast path is taken for the writer's own layout
    whole = store.tokens_array[:]
    assert np.array_equal(whole, np.concatenate(docs))
    for start in range(0, store.num_tokens, store.chunk):
        stop = min(start + store.chunk, store.num_tokens)
        assert np.array_equal(store.read(start, stop), whole[start:stop])
        assert store.read(start, stop).dtype == whole.dtype
    assert np.array_equal(store.read(100, CHUNK_TOKENS + 50), whole[100 : CHUNK_TOKENS + 50])  # across a chunk edge
    # a layout the fast path does not know goes through zarr, with the same result
    meta_path = tmp_path / "s.zarr" / "tokens" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"][1]["configuration"]["checksum"] = False
    meta["storage_transformers"] = [{"name": "unknown"}]
    assert _direct_is_refused(meta, tmp_path)


def _direct_is_refused(meta, tmp_path):
    from titan_audit.data.token_store import _direct_reader

    other = tmp_path / "other"
    other.mkdir()
    (other / "zarr.json").write_text(json.dumps(meta))
    return _direct_reader(other, np.dtype(np.uint16), meta["chunk_grid"]["configuration"]["chunk_shape"][0]) is None
