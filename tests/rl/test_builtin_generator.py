"""The built-in generator (rl/builtin.py) on tiny-dense (random init).

- G4: in BI mode every reported log-prob equals, bitwise, the trainer's recomputation
  `sequence_logprobs` (one full forward of prompt + completion, no cache), for random prompt
  lengths, arrival orders and batch compositions, n > 1 samples per prompt, temperature != 1,
  top-k and top-p on; negative control (constructed, rl/control.py): the generator loaded with the
  trainer's weights one ulp off in one element leaves a gap. Native ops (BI off) are only bounded:
  whether they leave a gap depends on the CPU's libraries.
- A sample's tokens (and log-probs) are the same alone, in any batch and in any arrival order.
- Continuous batching: samples join and leave the decode batch between steps, prefill shares an
  iteration with decode, a prompt is prefilled once for its n samples, every block comes back.
- Stop tokens / max_new_tokens give finish_reason "stop" / "length"; top-k is respected.
- load_weights / weights_fingerprint / policy_version; bad input is a ValueError naming the request.
"""

import random

import pytest
import torch

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import bits, fingerprint
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.control import generator_weights
from titan_audit.rl.generator import GenerationRequest, Generator, SampleKey, SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs

TEMPERATURE = 0.7
PARAMS = SamplingParams(temperature=TEMPERATURE, top_k=40, top_p=0.9, max_new_tokens=5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # 2 shared cores: one intra-op thread keeps OpenMP teams from stalling each other
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model():
    return models.build("tiny-dense", seed=0)


@pytest.fixture(scope="module")
def requests():
    """5 prompts of random lengths (2..40 tokens), 1-3 samples each."""
    rng = random.Random(0)
    out = []
    for prompt_id in range(5):
        prompt = tuple(rng.randrange(2048) for _ in range(rng.randint(2, 40)))
        for sample_index in range(rng.randint(1, 3)):
            key = SampleKey(seed=3, step=1, prompt_id=prompt_id, sample_index=sample_index)
            out.append(GenerationRequest(prompt, key))
    assert any(r.key.sample_index > 0 for r in out)
    return out


def _generate(model, requests, params=PARAMS, **config):
    gen = BuiltinGenerator(model, BuiltinGeneratorConfig(**config))
    return gen, gen.generate(requests, params)


def _by_key(samples):
    return {s.key: s for s in samples}


def _bits_equal(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def _recompute(model, samples, batch_invariant=True, temperature=TEMPERATURE):
    with torch.no_grad():
        return sequence_logprobs(
            model,
            [s.prompt_ids for s in samples],
            [s.tokens for s in samples],
            temperature,
            batch_invariant=batch_invariant,
        )


def test_the_builtin_generator_implements_the_interface(model):
    assert isinstance(BuiltinGenerator(model), Generator)


def test_bi_logprobs_equal_the_trainer_recomputation_bitwise_in_any_order_and_batch(model, requests):
    reference = None
    orders = [list(range(len(requests))), list(reversed(range(len(requests))))]
    orders.append(random.Random(1).sample(range(len(requests)), len(requests)))
    for order, max_batch in zip(orders, (64, 3, 2)):
        gen, samples = _generate(model, [requests[i] for i in order], batch_invariant=True, max_batch_size=max_batch)
        assert [s.key for s in samples] == [requests[i].key for i in order]
        recomputed = _recompute(model, samples)
        for s, lp in zip(samples, recomputed):
            assert len(s.tokens) == len(s.logprobs) >= 1 and s.logprobs.dtype == torch.float32
            assert _bits_equal(s.logprobs, lp), (s.key, s.logprobs, lp)
        got = _by_key(samples)
        if reference is None:
            reference = got
            continue
        for key, s in got.items():  # the same tokens and log-prob bits in every order and batch
            assert s.tokens == reference[key].tokens and _bits_equal(s.logprobs, reference[key].logprobs)
    # n samples of one prompt differ (their keys differ), so the equality above is not vacuous
    same_prompt = [s for k, s in reference.items() if k.prompt_id == requests[0].key.prompt_id]
    assert len({tuple(s.tokens) for s in same_prompt}) == len(same_prompt) > 1


def test_a_samples_tokens_are_the_same_alone_and_in_a_batch(model, requests):
    _, together = _generate(model, requests, batch_invariant=True)
    for request, sample in zip(requests, together):
        _, (alone,) = _generate(model, [request], batch_invariant=True)
        assert alone.tokens == sample.tokens and _bits_equal(alone.logprobs, sample.logprobs)


def test_recomputation_is_bitwise_the_same_alone_and_with_grad(model, requests):
    _, samples = _generate(model, requests[:4], batch_invariant=True)
    batched = _recompute(model, samples)
    for s, lp in zip(samples, batched):
        (alone,) = _recompute(model, [s])
        assert _bits_equal(alone, lp)
    with_grad = sequence_logprobs(model, [s.prompt_ids for s in samples], [s.tokens for s in samples], TEMPERATURE)
    assert with_grad[0].requires_grad
    assert all(_bits_equal(a.detach(), b) for a, b in zip(with_grad, batched))


@pytest.mark.control
def test_negative_control_weights_one_ulp_off_leave_a_gap(model, requests):
    """The constructed control: the generator holds the trainer's weights with one element one ulp
    off (rl/control.py); in BI mode its log-probs then differ from the trainer's recomputation."""
    gen = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True))
    sent = generator_weights(model.state_dict(), "generator-weight-ulp")
    assert sum(not torch.equal(bits(sent[n]), bits(t)) for n, t in model.state_dict().items()) == 1
    gen.load_weights(sent, 1)
    samples = gen.generate(requests, PARAMS)
    recomputed = _recompute(model, samples)
    differing = sum(int((bits(s.logprobs) != bits(lp)).sum()) for s, lp in zip(samples, recomputed))
    assert differing > 0
    gap = max(float((s.logprobs - lp).abs().max()) for s, lp in zip(samples, recomputed))
    assert 0 < gap < 1e-3  # one ulp of one weight: a rounding-sized gap, which the check still sees


def test_without_bi_mode_the_logprobs_are_the_same_math(model, requests):
    """Native ops: the trainer's recomputation is close (whether any bit differs depends on the
    CPU's libraries, so it is printed, never asserted)."""
    assert not bi.is_enabled()
    _, samples = _generate(model, requests, batch_invariant=False)
    recomputed = _recompute(model, samples, batch_invariant=False)
    differing = sum(not _bits_equal(s.logprobs, lp) for s, lp in zip(samples, recomputed))
    gap = max(float((s.logprobs - lp).abs().max()) for s, lp in zip(samples, recomputed))
    print(f"native ops: {differing} of {len(samples)} samples' log-probs differ from the recomputation, max {gap:.3g}")
    assert gap < 1e-3


def test_continuous_batching_schedule_and_prefix_sharing(model, requests):
    stop = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6)
    _, free = _generate(model, requests, stop, batch_invariant=True)
    # stop tokens that end some samples early, so samples leave the batch at different steps
    stops = tuple(sorted({s.tokens[1] for s in free[::2]}))
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, stop_token_ids=stops)
    gen, samples = _generate(model, requests, params, batch_invariant=True, max_batch_size=3)
    schedule = gen.last_schedule
    # one prefill per prompt, never per sample
    prefilled = [first for it in schedule for call in it.prefilled for first in call]
    assert sorted(prefilled) == sorted(
        {min(i for i, r in enumerate(requests) if r.key.prompt_id == p) for p in {r.key.prompt_id for r in requests}}
    )
    assert all(len(it.decoded) <= 3 for it in schedule)
    # prompts of different lengths share a (right-padded) prefill call
    lengths = {i: len(r.prompt_ids) for i, r in enumerate(requests)}
    assert any(len({lengths[i] for i in call}) > 1 for it in schedule for call in it.prefilled)
    # samples join a running batch and leave it while others keep decoding
    assert any(it.decoded and (it.prefilled or it.started) for it in schedule)
    assert any(
        set(a.decoded) - set(b.decoded) and set(a.decoded) & set(b.decoded) for a, b in zip(schedule, schedule[1:])
    )
    assert any(
        set(b.decoded) - set(a.decoded) and set(a.decoded) & set(b.decoded) for a, b in zip(schedule, schedule[1:])
    )
    assert sorted(i for it in schedule for i in it.finished) == list(range(len(requests)))
    cache = gen._cache
    assert not cache.lengths and cache.num_free_blocks == cache.num_blocks  # every block released
    # finish reasons, and a stopped sample is the prefix of its free run up to the stop token
    reference = _by_key(free)
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    for s in samples:
        full = reference[s.key].tokens
        if s.finish_reason == "stop":
            assert s.tokens[-1] in stops and all(t not in stops for t in s.tokens[:-1])
            assert s.tokens == full[: len(s.tokens)]
        else:
            assert len(s.tokens) == 6 and not set(s.tokens) & set(stops)
    for s, lp in zip(samples, _recompute(model, samples)):
        assert _bits_equal(s.logprobs, lp)


def test_max_new_tokens_one_and_a_stop_at_the_first_token(model, requests):
    gen, samples = _generate(
        model, requests, SamplingParams(temperature=TEMPERATURE, max_new_tokens=1), batch_invariant=True
    )
    assert all(len(s.tokens) == 1 and s.finish_reason == "length" for s in samples)
    first = samples[0].tokens[0]
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=4, stop_token_ids=(first,))
    _, again = _generate(model, requests[:1], params, batch_invariant=True)
    assert again[0].tokens == [first] and again[0].finish_reason == "stop"
    assert not gen._cache.lengths


def test_top_k_is_respected_against_the_trainer_logits(model, requests):
    for k in (1, 3):
        params = SamplingParams(temperature=TEMPERATURE, top_k=k, max_new_tokens=4)
        _, samples = _generate(model, requests[:4], params, batch_invariant=True)
        for s in samples:
            row = torch.tensor([list(s.prompt_ids) + s.tokens])
            with torch.no_grad(), bi.enabled():
                logits_TV = model(row)[0, len(s.prompt_ids) - 1 : -1]
            for token, logits_V in zip(s.tokens, logits_TV):
                order = sorted(range(len(logits_V)), key=lambda t: (-float(logits_V[t]), t))
                assert token in order[:k]


def test_weights_copy_load_and_fingerprint(model, requests):
    trainer = models.build("tiny-dense", seed=0)
    gen = BuiltinGenerator(trainer, BuiltinGeneratorConfig(batch_invariant=True), policy_version=3)
    assert gen.policy_version == 3
    assert gen.weights_fingerprint() == {n: fingerprint(t) for n, t in trainer.state_dict().items()}
    before = gen.generate(requests[:2], PARAMS)
    with torch.no_grad():
        trainer.norm.weight.mul_(2.0)  # the trainer updates its model: the generator's copy is its own
    assert gen.weights_fingerprint() != {n: fingerprint(t) for n, t in trainer.state_dict().items()}
    assert [s.tokens for s in gen.generate(requests[:2], PARAMS)] == [s.tokens for s in before]
    gen.load_weights(trainer.state_dict(), policy_version=4)
    assert gen.policy_version == 4
    assert gen.weights_fingerprint() == {n: fingerprint(t) for n, t in trainer.state_dict().items()}
    after = gen.generate(requests[:2], PARAMS)
    assert all(s.policy_version == 4 for s in after) and all(s.policy_version == 3 for s in before)
    assert [s.logprobs.tolist() for s in after] != [s.logprobs.tolist() for s in before]
    # in-place loads reach every kernel (no stale packed weight): bitwise the new trainer's log-probs
    for s, lp in zip(after, _recompute(trainer, after)):
        assert _bits_equal(s.logprobs, lp)


def test_load_weights_rejects_a_state_dict_of_another_model(model):
    gen = BuiltinGenerator(model)
    state = dict(model.state_dict())
    name = "layers.0.mlp.up_proj.weight" if "layers.0.mlp.up_proj.weight" in state else next(iter(state))
    with pytest.raises(ValueError, match="missing"):
        gen.load_weights({k: v for k, v in state.items() if k != name}, 1)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        gen.load_weights({**state, name: state[name][:-1]}, 1)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        gen.load_weights({**state, name: state[name].double()}, 1)
    assert gen.policy_version == 0


def _request(ids, prompt_id=0, sample_index=0):
    return GenerationRequest(tuple(ids), SampleKey(0, 0, prompt_id, sample_index))


@pytest.mark.parametrize(
    "bad,match",
    [
        ([_request([1, 2]), _request([])], "request 1 .*empty prompt"),
        ([_request([1, 2048])], "request 0 .*token id 2048"),
        ([_request([1, -1])], "request 0 .*token id -1"),
        ([_request([1] * 2046)], "request 0 .*2046 tokens \\+ max_new_tokens 5 exceeds .*2048"),
        ([_request([1, 2]), _request([1, 2])], "request 1 .*same sample key as request 0"),
        ([_request([1, 2]), _request([1, 3], sample_index=1)], "request 1 .*different prompt tokens"),
        ([GenerationRequest((1,), SampleKey(0, 0, -5, 0))], "request 0: sample key prompt_id"),
    ],
)
def test_bad_requests_are_value_errors_naming_the_request(model, bad, match):
    gen = BuiltinGenerator(model)
    with pytest.raises(ValueError, match=match):
        gen.generate(bad, PARAMS)


def test_a_request_beyond_the_cache_capacity_and_a_bad_stop_token(model):
    gen = BuiltinGenerator(model, BuiltinGeneratorConfig(num_blocks=4, block_size=8))
    with pytest.raises(ValueError, match="request 1 .*needs 5 KV-cache blocks.*capacity of 4"):
        gen.generate([_request([1] * 8), _request([1] * 28, prompt_id=1)], PARAMS)
    two_samples = [_request([1] * 12, sample_index=0), _request([1] * 12, sample_index=1)]
    gen.generate(two_samples[:1], PARAMS)  # one sample: 3 blocks; two: its prompt's 2 more
    with pytest.raises(ValueError, match="request 0 .*needs 5 KV-cache blocks.*capacity of 4"):
        gen.generate(two_samples, PARAMS)
    with pytest.raises(ValueError, match="stop token id 5000"):
        gen.generate([_request([1])], SamplingParams(stop_token_ids=(5000,)))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    # a small fixed cache still serves many samples: they wait for blocks and reuse them
    requests = [_request([1, 2, 3], prompt_id=p, sample_index=s) for p in range(3) for s in range(2)]
    samples = gen.generate(requests, PARAMS)
    assert [s.key for s in samples] == [r.key for r in requests]
    alone = BuiltinGenerator(model).generate(requests, PARAMS)
    assert [s.tokens for s in samples] == [s.tokens for s in alone]


@pytest.mark.parametrize("preset,compute_dtype", [("tiny-dense", torch.bfloat16), ("tiny-moe", None)])
def test_bi_logprobs_bitwise_with_bf16_compute_and_moe(preset, compute_dtype, requests):
    model = models.build(preset, seed=0).set_compute_dtype(compute_dtype)
    params = SamplingParams(temperature=1.3, max_new_tokens=3)
    _, samples = _generate(model, requests[:6], params, batch_invariant=True, max_batch_size=4)
    for s, lp in zip(samples, _recompute(model, samples, temperature=1.3)):
        assert _bits_equal(s.logprobs, lp)


def test_numpy_integer_prompt_ids_are_accepted(model):
    import numpy as np

    ids = tuple(np.arange(1, 6, dtype=np.int64))
    (sample,) = BuiltinGenerator(model).generate([GenerationRequest(ids, SampleKey(0, 0, 0, 0))], PARAMS)
    assert sample.prompt_ids == (1, 2, 3, 4, 5) and all(type(t) is int for t in sample.prompt_ids)


@pytest.mark.parametrize("max_batch,num_blocks", [(1, None), (2, 11), (4, 16)])
def test_tight_slots_and_blocks_change_the_schedule_not_the_samples(model, requests, max_batch, num_blocks):
    """Prompts with more samples than slots start them over several iterations (their sequence
    is kept until the last one), prompts wait for blocks; the samples stay bitwise the same."""
    params = SamplingParams(temperature=TEMPERATURE, top_k=40, max_new_tokens=4, stop_token_ids=(7, 99, 1234))
    _, reference = _generate(model, requests, params, batch_invariant=True)
    config = dict(batch_invariant=True, max_batch_size=max_batch, num_blocks=num_blocks, block_size=8)
    gen, samples = _generate(model, requests, params, **config)
    assert all(len(it.decoded) <= max_batch for it in gen.last_schedule)
    assert len(gen.last_schedule) > len(reference[0].tokens)
    for s, ref in zip(samples, reference):
        assert s.key == ref.key and s.tokens == ref.tokens and s.finish_reason == ref.finish_reason
        assert _bits_equal(s.logprobs, ref.logprobs)
    assert not gen._cache.lengths and gen._cache.num_free_blocks == gen._cache.num_blocks


def test_paged_cache_truncate_returns_blocks_and_keeps_the_prefix(model):
    cache = models.PagedKVCache(model.config, num_blocks=8, block_size=4)
    cache.add("a")
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad(), bi.enabled():
        full = model(tokens)[0]
        model(torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0, 0]]), cache=cache.batch(["a"]))  # padded prefill
        assert cache.num_free_blocks == 5
        cache.truncate("a", 3)
        assert cache.length("a") == 3 and cache.num_free_blocks == 7
        rest = model(tokens[:, 3:], cache=cache.batch(["a"]))[0]
    assert _bits_equal(rest, full[3:])  # the padding's entries are invisible after truncation
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate("a", 8)
