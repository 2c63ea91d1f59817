"""The loader in one process: microbatch contents, prefetch invariance, resume, O(1) resume, source checks.

Multi-rank delivery on real gloo processes is in test_loader_distributed.py.
"""

import shutil
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_audit.audit import assert_bitwise_equal, bitwise_equal
from titan_audit.data import ElasticLoader, LoaderConfig, LoaderState, PrepareConfig, prepare
from titan_audit.data import concat as concat_microbatches
from titan_audit.data.microbatch import TENSOR_FIELDS


def _config(store, **overrides):
    base = dict(store=str(store), seq_len=48, global_batch_size=8, microbatch_size=2, seed=3)
    return LoaderConfig(**{**base, **overrides})


def _take(loader, count):
    out = []
    for mb in loader:
        out.append(mb)
        if len(out) == count:
            break
    return out


def _assert_same(a, b, what):
    assert [(m.epoch, m.step, m.index, m.global_loss_tokens) for m in a] == [
        (m.epoch, m.step, m.index, m.global_loss_tokens) for m in b
    ]
    for name, x in concat_microbatches(a).items():
        assert_bitwise_equal(x, concat_microbatches(b)[name], f"{what}: {name}")


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_microbatch_fields_shapes_and_normaliser(store, packing):
    with ElasticLoader(_config(store, packing=packing)) as loader:
        assert loader.num_microbatches == 4
        mbs = _take(loader, 8)  # two steps
    for mb in mbs:
        assert (
            mb.tokens.shape
            == mb.targets.shape
            == mb.positions.shape
            == mb.doc_ids.shape
            == mb.loss_mask.shape
            == (2, 48)
        )
        assert mb.sequence_ids.shape == (2,)
        assert mb.tokens.dtype == mb.targets.dtype == mb.positions.dtype == mb.doc_ids.dtype == torch.int64
        assert mb.loss_mask.dtype == torch.bool
        assert torch.equal(mb.targets[:, :-1], mb.tokens[:, 1:])
        mask = mb.attention_mask()
        assert mask.shape == (2, 48, 48) and not mask.triu(1).any()
        same_doc = mb.doc_ids[:, :, None] == mb.doc_ids[:, None, :]
        assert torch.equal(mask, same_doc.tril())
    for step in (0, 1):
        group = [m for m in mbs if m.step == step]
        assert [m.index for m in group] == [0, 1, 2, 3]
        total = sum(m.num_loss_tokens for m in group)
        assert all(m.global_loss_tokens == total for m in group)  # the normaliser is the whole batch's count
        assert 0 < total <= 8 * 48
    assert mbs[0].global_loss_tokens != mbs[4].global_loss_tokens or not bitwise_equal(mbs[0].tokens, mbs[4].tokens)


def test_prefetch_workers_and_depth_do_not_change_the_bytes(store):
    steps = 6
    with ElasticLoader(_config(store)) as loader:
        reference = _take(loader, steps * 4)
    variants = [
        dict(workers=0, worker_type="process"),
        dict(workers=1, prefetch=1),
        dict(workers=4, prefetch=3),
        dict(workers=4, prefetch=1),
        dict(workers=2, prefetch=2, worker_type="process"),
    ]
    for variant in variants:
        with ElasticLoader(_config(store, **variant)) as loader:
            _assert_same(reference, _take(loader, steps * 4), f"workers {variant}")
    with ElasticLoader(_config(store, packing="best_fit")) as loader:
        best_fit = _take(loader, 8)
    with ElasticLoader(_config(store, packing="best_fit", workers=3, prefetch=5)) as loader:
        _assert_same(best_fit, _take(loader, 8), "best_fit with workers")
    # negative control: another seed delivers other bytes, so the comparison above can fail
    with ElasticLoader(_config(store, seed=4)) as loader:
        other = _take(loader, steps * 4)
    assert not bitwise_equal(concat_microbatches(other)["tokens"], concat_microbatches(reference)["tokens"])


def test_each_epoch_is_a_fresh_permutation_without_repeats(store):
    config = _config(store, seq_len=400, global_batch_size=8, microbatch_size=4, num_epochs=2)
    with ElasticLoader(config) as loader:
        per_epoch = loader.steps_per_epoch
        mbs = list(loader)
        assert loader.state().epoch == 2  # ran to the end
    assert len(mbs) == 2 * per_epoch * 2
    ids = {e: torch.cat([m.sequence_ids for m in mbs if m.epoch == e]) for e in (0, 1)}
    for e in (0, 1):
        assert len(set(ids[e].tolist())) == per_epoch * 8  # no sequence twice in an epoch
        assert max(ids[e].tolist()) < loader.batches.num_sequences
    assert not torch.equal(ids[0], ids[1])  # the order changes with the epoch


def test_resume_from_a_saved_state_continues_identically(store, tmp_path):
    with ElasticLoader(_config(store)) as loader:
        uninterrupted = _take(loader, 10 * 4)
    with ElasticLoader(_config(store)) as loader:
        _take(loader, 4 * 4)
        state = loader.state()
        assert (state.epoch, state.step) == (0, 4)
        state.save(tmp_path / "state.json")
    with pytest.raises(ValueError, match="already exists"):
        state.save(tmp_path / "state.json")
    loaded = LoaderState.load(tmp_path / "state.json")
    assert loaded == state
    # resume on "rank 1 of 2" and "rank 0 of 4" too: the state is rank-agnostic
    with ElasticLoader(_config(store), state=loaded) as resumed:
        _assert_same(uninterrupted[16:], _take(resumed, 6 * 4), "resumed")
    with ElasticLoader(_config(store), rank=1, world_size=2, state=loaded) as resumed:
        got = _take(resumed, 2)
    _assert_same([m for m in uninterrupted if m.step == 4 and m.index in (2, 3)], got, "resumed at W=2")
    # negative control: resuming one step later is different
    later = LoaderState(0, 5, state.spec, state.manifest_digest, state.manifest)
    with ElasticLoader(_config(store), state=later) as resumed:
        assert not bitwise_equal(_take(resumed, 1)[0].tokens, uninterrupted[16].tokens)


def _time_to_first_batch(store, global_step):
    with ElasticLoader(_config(store)) as probe:
        probe.seek(global_step)
        state = probe.state()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        with ElasticLoader(_config(store), state=state) as loader:
            first = next(iter(loader))
        best = min(best, time.perf_counter() - start)
    return best, first


def test_resume_cost_does_not_grow_with_the_step(store):
    near, first_near = _time_to_first_batch(store, 10)
    far, first_far = _time_to_first_batch(store, 100_000)
    assert first_far.epoch > 100 and first_near.epoch == 0  # really far into training
    assert far < 1.5 * near + 0.05, (near, far)
    with ElasticLoader(_config(store)) as loader:
        loader.seek(100_000)
        assert loader.global_step == 100_000
        direct = loader.global_batch(loader.epoch, loader.step)[0]
    assert_bitwise_equal(direct.tokens, first_far.tokens, "seek == global_batch")


def test_a_changed_store_file_is_refused_at_resume(store, tmp_path):
    copy = tmp_path / "copy.zarr"
    shutil.copytree(store, copy)
    with ElasticLoader(_config(copy)) as loader:
        _take(loader, 4)
        state = loader.state()
    with ElasticLoader(_config(copy), state=state):  # negative control: unchanged source resumes
        pass
    chunk = copy / "tokens" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tokens/c/0: changed \(hash .*allow_source_change"):
        ElasticLoader(_config(copy), state=state)
    with ElasticLoader(_config(copy), state=state, allow_source_change=True) as loader:
        assert loader.state().manifest_digest != state.manifest_digest


def test_a_changed_source_file_is_named_at_resume(corpus, tmp_path):
    import pyarrow.parquet as pq

    source = tmp_path / "tasks.parquet"
    shutil.copy(corpus, source)
    prepare(PrepareConfig(sources=(str(source),), out=str(tmp_path / "s.zarr")))
    with ElasticLoader(_config(tmp_path / "s.zarr")) as loader:
        state = loader.state()
    table = pq.read_table(source)
    table = table.set_column(4, "text", [[t.upper() for t in table.column("text").to_pylist()]])
    pq.write_table(table, source, row_group_size=400)
    prepare(PrepareConfig(sources=(str(source),), out=str(tmp_path / "s.zarr"), overwrite=True))
    with pytest.raises(ValueError, match=r"source file tasks\.parquet: changed \(.*hash"):
        ElasticLoader(_config(tmp_path / "s.zarr"), state=state)


def test_state_must_match_the_batch_spec(store):
    with ElasticLoader(_config(store)) as loader:
        state = loader.state()
    with pytest.raises(ValueError, match="saved with seed=3 but the config has seed=9"):
        ElasticLoader(_config(store, seed=9), state=state)
    with pytest.raises(ValueError, match="saved with microbatch_size=2 but the config has microbatch_size=4"):
        ElasticLoader(_config(store, microbatch_size=4), state=state)


@pytest.mark.parametrize(
    "overrides, kwargs, match",
    [
        (
            dict(global_batch_size=10, microbatch_size=4),
            {},
            "global batch size 10 is not divisible by microbatch size 4",
        ),
        ({}, dict(rank=0, world_size=3), "world size 3 does not divide the 4 virtual microbatches"),
        ({}, dict(rank=2, world_size=2), r"rank 2 is outside \[0, 2\)"),
        (dict(seq_len=200_000), {}, r"cannot fill one sequence of length 200000"),
        (dict(global_batch_size=4096, microbatch_size=4), {}, r"cannot fill one global batch of 4096"),
        (dict(packing="random"), {}, "unknown packing 'random'"),
        (dict(workers=-1), {}, "workers must be >= 0, got -1"),
        (dict(prefetch=0), {}, "prefetch depth must be >= 1, got 0"),
    ],
)
def test_bad_numbers_fail_before_any_work(store, overrides, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElasticLoader(_config(store, **overrides), **kwargs)


def test_microbatch_tensor_fields_are_the_documented_ones():
    assert TENSOR_FIELDS == ("sequence_ids", "tokens", "targets", "positions", "doc_ids", "loss_mask")


@settings(max_examples=15)
@given(st.sampled_from([(1, 1), (2, 1), (3, 2), (4, 1), (6, 1), (8, 2), (12, 1)]), st.data())
def test_rank_blocks_tile_the_global_batch_for_any_divisor(store, v_m, data):
    """In-process (explicit rank, W): for any V, M and W dividing V, the ranks' blocks tile the step."""
    v, m = v_m
    world_size = data.draw(st.sampled_from([w for w in range(1, v + 1) if v % w == 0]))
    config = _config(store, global_batch_size=v * m, microbatch_size=m, seq_len=24)
    with ElasticLoader(config, rank=0, world_size=1) as reference:
        step = data.draw(st.integers(0, reference.steps_per_epoch - 1))
        expected = reference.global_batch(0, step)
        got = []
        for rank in range(world_size):
            with ElasticLoader(config, rank=rank, world_size=world_size) as loader:
                loader.seek(step)
                got.extend(_take(loader, v // world_size))
    _assert_same(expected, got, f"V={v} M={m} W={world_size} step {step}")
