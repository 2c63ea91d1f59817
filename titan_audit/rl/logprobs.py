"""The trainer's recomputation of a generator's log-probs: `sequence_logprobs`.

    lps = sequence_logprobs(model, prompts, completions, temperature)   # list of float32 [T_i]

For each sample i, `lps[i][t]` = log_softmax(logits / temperature)[completions[i][t]] over the
full vocabulary, the logits being those one full forward of prompt_i + completion_i (no KV cache)
gives at the position before token t. This is exactly what a generator reports
(rl/generator.py's docstring), computed the trainer's way.

Batching: the samples run as one right-padded batch [N, max_len] (positions 0..len-1 per row);
causal attention keeps padding invisible to real tokens. In batch-invariant mode
(`batch_invariant=True`, the default: the call runs inside `titan_audit.batch_invariant.enabled()`)
every op is row-invariant, so each sample's log-probs are bitwise those of running it alone,
whatever the other samples and the padded length, and bitwise equal to the built-in generator's
(guarantee G4; tests/rl/test_builtin_generator.py). The LM head, the log-softmax and the gather
run as one step at the positions whose logits give a completion token, for all samples at once
(the model's `logits_rows` with `logprob_targets`: the bits of the full head's rows, gradients
included). In BI mode on CPU that step runs in row chunks and vocabulary slices
(models/chunked_head.py): no [tokens, vocab] tensor is ever held, forward or backward; with
native ops (any device) it runs in row chunks once the [tokens, vocab] logits would exceed one
buffer; elsewhere (BI mode on CUDA, a tensor-parallel head) it holds the [tokens, vocab] logits
and their log-softmax. With `batch_invariant=False` the call
runs in whatever mode the caller is in (native ops outside BI mode: no bitwise promise).

Autograd: nothing here disables it; call it under `torch.no_grad()` to score only, or with grad
enabled to get the policy-gradient graph (the BI forward kernels, hence the bits, are the same
either way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from titan_audit import batch_invariant as bi
from titan_audit.models.transformer import Transformer


def sequence_logprobs(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    *,
    batch_invariant: bool = True,
) -> list[torch.Tensor]:
    """Per sample, the float32 log-probs [len(completion)] of its completion tokens given its
    prompt; see the module doc."""
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    if not (isinstance(temperature, (int, float)) and temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not prompts:
        return []
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if len(prompt) == 0:
            raise ValueError(f"sample {i}: empty prompt")
        rows.append([int(t) for t in prompt] + [int(t) for t in completion])
    max_len = max(len(r) for r in rows)
    if max_len > model.config.max_position_embeddings:
        raise ValueError(
            f"a sample has {max_len} tokens, more than max_position_embeddings {model.config.max_position_embeddings}"
        )
    device = model.output_weight.device
    tokens_NL = torch.zeros(len(rows), max_len, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens_NL[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    tokens_NL = tokens_NL.to(device)
    # the head runs at the completion positions only: row i * max_len + t for t in
    # [start - 1, start - 1 + count), whose target is the token at t
    head_rows, targets = [], []  # flat token rows of the head; their targets
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = len(prompt)
        head_rows.extend(range(i * max_len + start - 1, i * max_len + start - 1 + len(completion)))
        targets.extend(rows[i][start:])
    if not head_rows:
        return [torch.zeros(0, dtype=torch.float32, device=device) for _ in prompts]
    mode = bi.enabled() if batch_invariant else contextlib.nullcontext()
    with mode:
        logprobs_R = model(
            tokens_NL,
            logits_rows=torch.tensor(head_rows, dtype=torch.long, device=device),
            logprob_targets=torch.tensor(targets, dtype=torch.long, device=device),
            temperature=temperature,
        )
    return list(logprobs_R.split([len(c) for c in completions]))
