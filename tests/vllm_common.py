"""Shared helpers of the vLLM generator tests (tests/rl/test_vllm_*.py): the skip marker, tiny
models, bitwise comparison and random prompt sets."""

from __future__ import annotations

import contextlib
import dataclasses

import command_line
import pytest
import torch
from command_line import cli, cli_here  # noqa: F401  (the vllm tests import them from here)

from titan_audit import models
from titan_audit.rl import vllm as rl_vllm
from titan_audit.rl.generator import GenerationRequest, Sample, SampleKey

needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(not rl_vllm.available(), reason=f"vLLM is not installed: {rl_vllm.INSTALL_HINT}"),
]


def tiny(preset: str = "tiny-dense", seed: int = 0) -> models.Transformer:
    """A 2-layer version of a tiny preset (vocab 512, context 1024): seconds per engine start."""
    config = dataclasses.replace(
        models.get_preset(preset), num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024
    )
    return models.build(config, seed=seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose float32 bits differ."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return int((bits(a) != bits(b)).sum())


def random_requests(
    seed: int, vocab: int, *, prompts: int, max_len: int, samples: tuple[int, int] = (1, 3), step: int = 1
) -> list[GenerationRequest]:
    """Prompts of random lengths 1..max_len, each with a random number of samples."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(prompts):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        ids = tuple(torch.randint(0, vocab, (length,), generator=g).tolist())
        for j in range(int(torch.randint(samples[0], samples[1] + 1, (1,), generator=g))):
            out.append(GenerationRequest(ids, SampleKey(seed, step, i, j)))
    return out


def same_samples(a: list[Sample], b: list[Sample]) -> list[str]:
    """Where two sample lists differ (tokens, log-prob bits, finish reason); empty if identical."""
    problems = []
    for x, y in zip(a, b, strict=True):
        if x.tokens != y.tokens:
            problems.append(f"{x.key}: tokens {x.tokens} != {y.tokens}")
        elif differing(x.logprobs, y.logprobs):
            problems.append(f"{x.key}: {differing(x.logprobs, y.logprobs)} log-probs differ")
        elif x.finish_reason != y.finish_reason:
            problems.append(f"{x.key}: finish {x.finish_reason} != {y.finish_reason}")
    return problems


@contextlib.contextmanager
def one_thread():
    """Generation on 1 intra-op thread (vLLM's own choice; much faster on a loaded 2-core box).
    The BI bits do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_line_error(proc, pattern: str) -> str:
    """command_line.one_line_error without vLLM's and Triton's own stderr lines."""
    return command_line.one_line_error(proc, pattern, ignore=_NOISE)


# what importing vLLM prints on stderr before any of our output (its own import-time messages)
_NOISE = ("Triton ", "/work", "  ", "[W")
