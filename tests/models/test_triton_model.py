"""The batch-invariant model on the Triton backend, run by Triton's interpreter on CPU tensors
(marker `triton`; `backend.forced("triton")`, gemm order v2): what a CUDA run does, op for op. The
same tests but the census one run compiled on a GPU (marker `gpu`, scripts/gpu_check.sh).

- Census: a forward + backward of a one-layer model (GQA, qk-norm, SwiGLU, a K the v2 tree
  splits) runs no compiled CPU kernel of ours (every one is forbidden in the block) and no native
  aten op (strict census: only our Triton kernels and the exact allowlist). Control: in the same
  block a native op and a CPU kernel are refused.
- A sequence's logits are the same alone as in a batch, bitwise (control: alone in gemm order v1,
  in the batch in v2, they are not).
- The full forward == chunked prefill == token-by-token decode through the paged KV cache
  (control: the cached path in gemm order v1, the full forward in v2, differ).
- G4 for a few RL steps: the built-in generator's log-probs == the trainer's recomputation,
  bitwise, after each policy update. Control: the trainer on the CPU backend gives a gap.
The bits are the Triton backend's, not the CPU backend's (another order inside each kernel);
the results agree with the CPU backend to float32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from batch_invariant._triton import triton_on_cpu

from titan_audit import batch_invariant as bi
from titan_audit import models
from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant import backend, census
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.models.config import ModelConfig
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs

# One layer, small enough for the interpreter; intermediate 128 makes the down projection's K split
# into P(128) = 2 blocks of gemm order v2, so gemm order v1 sums it in another order (the controls).
CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=64,
)
TEMPERATURE = 0.8


class CpuKernelCalled(AssertionError):
    pass


@pytest.fixture(scope="module")
def cpu_model() -> models.Transformer:
    m = models.build(CONFIG, seed=0)
    with torch.no_grad():
        m(torch.zeros(1, 2, dtype=torch.long))  # the RoPE table: built once on CPU by our trig kernel
    return m


# Where the Triton kernels run: the interpreter on CPU tensors (CI), or compiled on a GPU (the same
# tests, marker `gpu`, run by scripts/gpu_check.sh; skipped without CUDA).
WHERE = [pytest.param("interpreter", marks=pytest.mark.triton), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=WHERE)
def where(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(cpu_model: models.Transformer, where: str) -> models.Transformer:
    if where == "interpreter":
        return cpu_model
    m = models.build(CONFIG, seed=0)
    m.load_state_dict(cpu_model.state_dict())
    return m.to("cuda")


def on_triton(where: str, order: str = "v2") -> contextlib.AbstractContextManager:
    """The Triton backend in gemm order `order`: forced onto CPU tensors, or CUDA tensors' own backend."""
    if where == "interpreter":
        return triton_on_cpu(order)
    pytest.importorskip("triton", reason="triton is not installed (the `test` extra brings it)")
    return bi.gemm_order(order)


def _tokens(seed: int, batch: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=g).to(device)


@contextlib.contextmanager
def only_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """BI mode on the Triton kernels with every compiled CPU kernel forbidden and a strict census."""

    def forbidden(name: str):
        raise CpuKernelCalled(f"the CPU kernel {name!r} ran on the Triton path")

    with triton_on_cpu(), bi.enabled(), census.strict(), monkeypatch.context() as patch:
        patch.setattr(_lib, "kernel", forbidden)
        yield


def _loss_and_grads(model: models.Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    loss = -logprobs.gather(-1, tokens[:, 1:, None]).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.triton
def test_forward_backward_run_only_our_triton_kernels_and_exact_ops(cpu_model, monkeypatch):
    model = cpu_model
    tokens = _tokens(1, 2, 13)
    with only_triton(monkeypatch):
        loss, grads = _loss_and_grads(model, tokens)
        again, grads_again = _loss_and_grads(model, tokens)
        # controls: the guard refuses a native op and a CPU kernel in the same block
        with pytest.raises(census.NativeOpError):
            torch.tanh(torch.ones(3))
        with pytest.raises(CpuKernelCalled), backend.forced("cpu") as cpu_backend:
            cpu_backend.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert bitwise_equal(loss, again) and all(bitwise_equal(grads[n], grads_again[n]) for n in grads)
    with bi.enabled():  # the CPU backend: the same mathematics, other bits
        cpu_loss, cpu_grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, cpu_loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, cpu_grads[name], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
@torch.no_grad()
def alone_and_batched(model: models.Transformer, where: str) -> dict[str, list[torch.Tensor]]:
    """Each sequence's first 7 positions (causal: the same logits) in the batch of all ("batched",
    gemm order v2) and alone, in gemm order v2 and v1 (BI mode, the Triton backend)."""
    tokens = _tokens(2, 3, 11, model.output_weight.device)
    with on_triton(where), bi.enabled():
        out = {"batched": [row[:7] for row in model(tokens)]}
    for order in ("v2", "v1"):
        with on_triton(where, order), bi.enabled():
            out[order] = [model(tokens[i : i + 1, :7])[0] for i in range(len(tokens))]
    return out


def test_a_sequence_alone_equals_it_in_a_batch(alone_and_batched):
    assert all(bitwise_equal(a, b) for a, b in zip(alone_and_batched["v2"], alone_and_batched["batched"]))


def test_negative_control_a_sequence_alone_in_another_gemm_order_differs(alone_and_batched):
    assert not all(bitwise_equal(a, b) for a, b in zip(alone_and_batched["v1"], alone_and_batched["batched"]))


@pytest.fixture(scope="module")
@torch.no_grad()
def full_and_cached(model: models.Transformer, where: str) -> dict[str, torch.Tensor]:
    """The full forward ("full", gemm order v2), and the same logits from a 5-token prefill, a
    4-token chunk and decode steps through the paged cache, in gemm order v2 and v1 (BI mode, the
    Triton backend)."""
    tokens = _tokens(3, 2, 14, model.output_weight.device)
    with on_triton(where), bi.enabled():
        out = {"full": model(tokens)}
    for order in ("v2", "v1"):
        with on_triton(where, order), bi.enabled():
            cache = models.PagedKVCache(model.config, num_blocks=16, block_size=4)
            for seq in (0, 1):
                cache.add(seq)
            pieces = [model(tokens[:, :5], cache=cache.batch([0, 1])), model(tokens[:, 5:9], cache=cache.batch([0, 1]))]
            pieces += [model(tokens[:, t : t + 1], cache=cache.batch([0, 1])) for t in range(9, tokens.shape[1])]
            out[order] = torch.cat(pieces, 1)
    return out


def test_full_forward_equals_chunked_prefill_equals_decode_through_the_paged_cache(full_and_cached):
    assert bitwise_equal(full_and_cached["v2"], full_and_cached["full"])


def test_negative_control_the_cached_path_in_another_gemm_order_differs(full_and_cached):
    assert not bitwise_equal(full_and_cached["v1"], full_and_cached["full"])


def _requests(step: int) -> list[GenerationRequest]:
    prompts = [(5, 17, 3), (40, 2, 9, 77, 11, 6, 30)]
    return [
        GenerationRequest(prompt, SampleKey(seed=7, step=step, prompt_id=i, sample_index=j))
        for i, prompt in enumerate(prompts)
        for j in range(2)
    ]


def _recompute(model: models.Transformer, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        return sequence_logprobs(
            model, [s.prompt_ids for s in samples], [s.tokens for s in samples], TEMPERATURE, batch_invariant=True
        )


def test_generator_logprobs_equal_the_trainers_for_a_few_rl_steps(cpu_model, where):
    """The zero gap (G4) on the Triton path, across policy updates: generate, compare with the
    trainer's recomputation, take a gradient step on the samples' log-probs, reload the weights."""
    policy = models.build(CONFIG, seed=0)
    policy.load_state_dict(cpu_model.state_dict())
    policy = policy.to("cpu" if where == "interpreter" else "cuda")
    params = SamplingParams(temperature=TEMPERATURE, top_k=20, max_new_tokens=3)
    with on_triton(where):
        generator = BuiltinGenerator(policy, BuiltinGeneratorConfig(batch_invariant=True))
        for step in range(2):
            samples = generator.generate(_requests(step), params)
            recomputed = _recompute(policy, samples)
            for sample, logprobs in zip(samples, recomputed):
                assert bitwise_equal(sample.logprobs, logprobs), (step, sample.key)
            with bi.enabled():
                lp = sequence_logprobs(
                    policy, [s.prompt_ids for s in samples], [s.tokens for s in samples], TEMPERATURE
                )
                loss = -torch.cat(lp).sum()
                loss.backward()
            with torch.no_grad():
                for p in policy.parameters():
                    p.sub_(0.05 * p.grad)
                    p.grad = None
            generator.load_weights(policy.state_dict(), step + 1)
    with bi.enabled():  # control: the CPU backend's recomputation of the last samples has a gap
        cpu = _recompute(policy.to("cpu"), samples)
    assert any(not bitwise_equal(s.logprobs, lp) for s, lp in zip(samples, cpu))
