"""The skill of a model on a built-in RL task, for `train --until` (trainer/until.py loads this
module by name: the trainer layer never imports rl/).

    check(until, config)                                   # ValueError naming --until and the key
    value = evaluate(until, model, seed, batch_invariant)  # the metric of the model's weights

Guarantees:
- `evaluate` is a pure function of (the weights, seed, the spec): the held-out prompts are the
  task's (rl/tasks.py) drawn from the keyed stream (seed, "train.until", 0, i), never the RL run's
  "rl.prompts" stream; the samples are drawn by the built-in generator (rl/builtin.py, in BI mode
  when asked) with the keys SampleKey(seed, -1, i, j), the same at
  every evaluation, so the metric moves only with the weights (an unsharded model generates with
  its own module, `share=True`: nothing is copied); each sample is scored by the task's
  own reward (`rl.tasks.score`). `reward` is the mean reward, `accuracy` the fraction scoring 1.0
  (an exact answer), summed with math.fsum in request order. Collective when the weights are
  sharded (the generator gathers each parameter in turn).
- `check` refuses a task that is not a built-in one, and a corpus or model not on the byte
  tokenizer the built-in tasks speak.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams
from titan_audit.rl.tasks import TOKENIZER, Prompt, completion_text, make_prompt, score, task_names

STREAM = "train.until"  # the held-out prompts' keyed stream
SAMPLE_STEP = -1  # the sample keys' step: no RL step's


def check(until, config) -> None:
    """The task and, with a train config, its corpus and model (see the module docstring)."""
    if until.task not in task_names():
        raise ValueError(f"--until task={until.task!r}: not a built-in task; choose from {', '.join(task_names())}")
    if until.metric not in ("reward", "accuracy"):
        raise ValueError(f"--until: unknown metric {until.metric!r}; choose from reward, accuracy")
    if config is None:
        return
    if config.data.store is not None:
        from titan_audit.data import TokenStore

        info = TokenStore(config.data.store).info
        if info.tokenizer != TOKENIZER.identity:
            raise ValueError(
                f"--until evaluates the built-in task {until.task!r} on the byte tokenizer; data.store "
                f"{config.data.store} uses tokenizer {info.tokenizer}"
            )
    if config.model.model_config().vocab_size < TOKENIZER.vocab_size:
        raise ValueError(f"--until: the model's vocab_size is below the byte tokenizer's {TOKENIZER.vocab_size}")


def held_out_prompts(until, seed: int) -> list[Prompt]:
    """The held-out prompts of a run seeded `seed` (module docstring)."""
    return [make_prompt(until.task, seed, 0, i, stream=STREAM) for i in range(until.prompts)]


def evaluate(until, model: torch.nn.Module, seed: int, batch_invariant: bool) -> float:
    """The metric of `model`'s weights (module docstring)."""
    prompts = held_out_prompts(until, seed)
    share = not any(isinstance(p, DTensor) for p in model.parameters())  # a sharded model: one full copy
    generator = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=batch_invariant), share=share)
    requests = [
        GenerationRequest(p.ids, SampleKey(seed, SAMPLE_STEP, p.id, j)) for p in prompts for j in range(until.samples)
    ]
    params = SamplingParams(
        temperature=until.temperature, max_new_tokens=until.max_new_tokens, stop_token_ids=(TOKENIZER.eos_id,)
    )
    samples = generator.generate(requests, params)  # in request order: prompt by prompt, sample by sample
    rewards = [score(prompts[s.key.prompt_id], completion_text(s.tokens), s.key.sample_index) for s in samples]
    values = [float(r == 1.0) for r in rewards] if until.metric == "accuracy" else rewards
    return math.fsum(values) / len(values)
