"""The generator interface: what every rollout generator (built-in, vLLM) takes and returns.

A generator turns prompts (token ids) into sampled completions, and reports for every sampled
token its log-prob under the generator's own weights.

Which log-prob: `logprobs[t]` is log softmax(logits_t / temperature)[token_t] computed over the
*whole* vocabulary, i.e. the log-prob of the token under the temperature-scaled distribution,
before top-k / top-p truncation. top-k and top-p only restrict which tokens can be drawn (the
draw is from the renormalised truncated distribution); they do not change the reported log-prob.
That is the quantity the trainer recomputes (`log_softmax(logits / temperature)` of the
policy), so in batch-invariant mode the two agree bitwise (guarantee G4).

Determinism: sampling randomness for a sample comes only from its `SampleKey` (seed, step,
prompt id, sample index) and the decode position (counter-based streams), so a sample's tokens
never depend on the batch it was generated in, on the arrival order of requests or on timing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature > 0; top_k = 0 means no top-k; top_p = 1.0 means no top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
        ):
            raise ValueError(f"sampling temperature must be a finite number > 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens!r}")


@dataclass(frozen=True, order=True)
class SampleKey:
    """Identifies one sample and keys its random stream: sample `sample_index` of prompt
    `prompt_id` at RL step `step` of a run seeded `seed`."""

    seed: int
    step: int
    prompt_id: int
    sample_index: int


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate: its prompt's token ids and its key. Requests that share a
    (seed, step, prompt_id) share a prompt; a generator may fork their prefix."""

    prompt_ids: tuple[int, ...]
    key: SampleKey


@dataclass
class Sample:
    """One generated sample. `tokens` are the new tokens only (the stop token included when
    finish_reason == "stop"); `logprobs` is float32 [len(tokens)], see the module docstring;
    `policy_version` is the trainer step whose weights produced every token of it."""

    key: SampleKey
    prompt_ids: tuple[int, ...]
    tokens: list[int]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    policy_version: int
    extra: dict[str, object] = field(default_factory=dict)


@runtime_checkable
class Generator(Protocol):
    """What the RL loop needs from a generator."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Replace the generator's weights (a full, unsharded state dict of the models/ model)
        and mark them as policy version `policy_version`."""
        ...

    def weights_fingerprint(self) -> dict[str, str]:
        """name -> `audit.fingerprint` of every weight the generator now computes with."""
        ...

    @property
    def policy_version(self) -> int:
        """The version of the weights loaded now."""
        ...

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Sample]:
        """One sample per request, in request order. Raises ValueError for a request it cannot
        serve (a prompt longer than the model's context, an empty prompt, a token id out of range)
        before generating anything."""
        ...


def check_weights(
    state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], policy_version
) -> None:
    """What every generator's `load_weights` checks first: the same tensor names as the
    generator's model, each of its dtype and shape, and an int policy version; ValueError naming
    the first offending tensor."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"load_weights: state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, (dtype, shape) in expected.items():
        source = state_dict[name]
        if not isinstance(source, torch.Tensor) or tuple(source.shape) != tuple(shape) or source.dtype != dtype:
            got = f"{source.dtype} {tuple(source.shape)}" if isinstance(source, torch.Tensor) else type(source).__name__
            raise ValueError(f"load_weights: tensor {name!r} is {got}, the generator's is {dtype} {tuple(shape)}")
    if not isinstance(policy_version, int):
        raise ValueError(f"load_weights: policy_version must be an int, got {policy_version!r}")
