"""Validation of generation requests, shared by every generator.

Guarantee: a request a generator cannot serve (not a GenerationRequest, a bad key, an empty
prompt, a token id outside the vocabulary, a prompt too long for the context, two requests with
one key, one prompt id with two different prompts, a stop id outside the vocabulary) is a
ValueError naming the request, raised before anything is generated.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from titan_audit.rl.generator import GenerationRequest, SamplingParams
from titan_audit.rl.sampling import check_key

PromptGroups = dict[tuple[int, int, int], tuple[tuple[int, ...], list[int]]]


def is_token_id(value: object) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_requests(
    requests: Sequence[GenerationRequest],
    params: SamplingParams,
    vocab_size: int,
    context: int,
    context_name: str,
    distinct_prompts: bool = True,
) -> PromptGroups:
    """Validate every request (see the module doc) against a model of `vocab_size` tokens whose
    context (`context_name`, for the message) holds `context` positions.

    Returns the prompts: (seed, step, prompt_id) -> (prompt token ids, the indices of its
    requests in request order), in order of each prompt's first request. With
    `distinct_prompts=False` (continuing samples: one key may appear with longer prompts) the
    key and prompt-group checks are skipped and nothing is returned."""
    for stop in params.stop_token_ids:
        if not is_token_id(stop) or not 0 <= stop < vocab_size:
            raise ValueError(f"stop token id {stop!r} is not in [0, {vocab_size})")
    max_new = params.max_new_tokens
    groups: PromptGroups = {}
    keys: dict[object, int] = {}
    for i, request in enumerate(requests):
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"request {i}: expected a GenerationRequest, got {type(request).__name__}")
        try:
            check_key(request.key)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
        where = f"request {i} ({request.key})"
        ids = request.prompt_ids
        if len(ids) == 0:
            raise ValueError(f"{where}: empty prompt")
        bad = [t for t in ids if not is_token_id(t) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: prompt token id {bad[0]!r} is not an int in [0, {vocab_size})")
        if len(ids) + max_new > context:
            raise ValueError(
                f"{where}: prompt of {len(ids)} tokens + max_new_tokens {max_new} exceeds the "
                f"model's context ({context_name} {context})"
            )
        if not distinct_prompts:
            continue
        if request.key in keys:
            raise ValueError(f"{where}: the same sample key as request {keys[request.key]}")
        keys[request.key] = i
        group = (request.key.seed, request.key.step, request.key.prompt_id)
        ids = tuple(int(t) for t in ids)
        first = groups.setdefault(group, (ids, []))
        if first[0] != ids:
            raise ValueError(
                f"{where}: prompt_id {request.key.prompt_id} has different prompt tokens than request {first[1][0]}"
            )
        first[1].append(i)
    return groups if distinct_prompts else {}
