"""Verifiable RL tasks: per-step prompt sets and rewards in [0, 1].

    prompts = prompt_set("reversal", seed=0, step=5, count=8)    # [Prompt(id, task, text, answer, ids)]
    reward = score(prompts[0], completion_text, sample_index=3)   # float in [0, 1]

Tasks (the formats of data/synthetic.py, so a model warmed up on `titan-audit train`'s synthetic
corpus knows them; the model sees `prompt + " "` and should answer, then stop with EOS):
    arithmetic  "Compute: 37 + 58 =" -> "95"      reward 1 if exact, else 0
    reversal    "Reverse: lamp ->"   -> "pmal"    reward = shaped match over characters
    sorting     "Sort: 5 31 9 ->"    -> "5 9 31"  reward = shaped match over the numbers
    reversal-short  reversal of 3-4 letter words (easier: the RL recipe's task)
    copy        "Copy: lamp ->"      -> "lamp"    (easier; not in the warm-up corpus) like reversal
    mixed       each prompt draws one of arithmetic, reversal, sorting
Shaped match = (bag F1 + positional match) / 2, over characters (reversal, copy) or whitespace-
separated numbers (sorting): positional match = #{i : pred[i] == answer[i]} / max(len(pred),
len(answer)); bag F1 = the F1 of the two multisets (the right symbols in any order). It is 1 iff
the prediction is exact and 0 for an empty one, and gives partial credit on the way there.
The answers come from `data.synthetic.solve` (reversal, sorting, arithmetic).

Guarantees:
- `prompt_set(task, seed, step, count)` is a pure function of its arguments: prompt `i` of step
  `step` comes from the keyed stream `numpy_generator(seed, "rl.prompts", step, i)` alone, so any
  rank can build any prompt by its id, whatever the world size.
- `score` returns a float in [0, 1] or raises `RewardError` (a ValueError) naming the task, the
  step, the prompt id, the sample index and the completion, when the task's reward function
  raises or returns something that is not a finite number in [0, 1]. The RL loop lets it stop
  the run.
- Prompt ids are the run's tokenizer's ids: the byte tokenizer (data/tokenizer.py ByteTokenizer;
  EOS 256 is the stop token) unless the config names an HF tokenizer (`tokenizer.path`).
- `BuiltinTask` is the loop's view of a built-in task (`prompts(step)`, `score_group(...)`); the
  user's own task (prompts file + reward functions) is rl/user_task.py's `UserTask`, the same view.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from titan_audit.data.synthetic import solve
from titan_audit.data.tokenizer import ByteTokenizer
from titan_audit.deterministic import numpy_generator

TOKENIZER = ByteTokenizer()
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


class RewardError(ValueError):
    """A task's reward function raised or returned a value outside [0, 1] (or non-finite)."""


class NondeterministicRewardError(RewardError):
    """A reward function scored the same (prompt, completion, columns) twice with different bits."""


@dataclass(frozen=True)
class Prompt:
    id: int  # prompt id within its step (0 .. count-1)
    step: int
    task: str
    text: str  # what the model sees (the task prompt + " ")
    answer: str
    ids: tuple[int, ...] = None  # type: ignore[assignment]  # its token ids (default: byte-tokenized text)
    row: int | None = None  # the user's prompts file: the row it came from

    def __post_init__(self) -> None:
        if self.ids is None:
            object.__setattr__(self, "ids", encode_prompt(TOKENIZER, self.text))


def encode_prompt(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer.encode_batch([text])[0])


@dataclass(frozen=True)
class Task:
    """make(rng) -> the task prompt (without the trailing space); reward(prompt, completion) in [0, 1]."""

    name: str
    make: Callable[[np.random.Generator], str]
    answer: Callable[[str], str]
    reward: Callable[[str, str, str], float]  # (prompt, answer, completion) -> [0, 1]


def positional_match(pred: list[str] | str, answer: list[str] | str) -> float:
    """#{i : pred[i] == answer[i]} / max(len(pred), len(answer)); 0.0 when both are empty."""
    n = max(len(pred), len(answer))
    if n == 0:
        return 0.0
    return sum(a == b for a, b in zip(pred, answer)) / n


def bag_f1(pred: list[str] | str, answer: list[str] | str) -> float:
    """F1 of the multisets of symbols of pred and answer; 0.0 when either is empty."""
    if not pred or not answer:
        return 0.0
    common = sum((Counter(pred) & Counter(answer)).values())
    return 2.0 * common / (len(pred) + len(answer))


def shaped_match(pred: list[str] | str, answer: list[str] | str) -> float:
    return 0.5 * (bag_f1(pred, answer) + positional_match(pred, answer))


def _make_arithmetic(rng: np.random.Generator) -> str:
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    return f"Compute: {a} {'+-*'[int(rng.integers(3))]} {b} ="


def _make_reversal(rng: np.random.Generator) -> str:
    return f"Reverse: {''.join(rng.choice(_LETTERS, size=int(rng.integers(3, 13))))} ->"


def _make_short_reversal(rng: np.random.Generator) -> str:
    return f"Reverse: {''.join(rng.choice(_LETTERS, size=int(rng.integers(3, 5))))} ->"


def _make_sorting(rng: np.random.Generator) -> str:
    values = rng.integers(0, 100, size=int(rng.integers(3, 9)))
    return f"Sort: {' '.join(map(str, values.tolist()))} ->"


def _make_copy(rng: np.random.Generator) -> str:
    return f"Copy: {''.join(rng.choice(_LETTERS, size=int(rng.integers(3, 9))))} ->"


def _copy_answer(prompt: str) -> str:
    return prompt.removeprefix("Copy: ").removesuffix(" ->")


_TASKS: dict[str, Task] = {
    "arithmetic": Task(
        "arithmetic", _make_arithmetic, lambda p: solve("arithmetic", p), lambda p, a, c: 1.0 if c.strip() == a else 0.0
    ),
    "reversal": Task(
        "reversal", _make_reversal, lambda p: solve("reversal", p), lambda p, a, c: shaped_match(c.strip(), a)
    ),
    "reversal-short": Task(
        "reversal-short",
        _make_short_reversal,
        lambda p: solve("reversal", p),
        lambda p, a, c: shaped_match(c.strip(), a),
    ),
    "sorting": Task(
        "sorting", _make_sorting, lambda p: solve("sorting", p), lambda p, a, c: shaped_match(c.split(), a.split())
    ),
    "copy": Task("copy", _make_copy, _copy_answer, lambda p, a, c: shaped_match(c.strip(), a)),
}
MIXED = ("arithmetic", "reversal", "sorting")


def task_names() -> tuple[str, ...]:
    return (*sorted(_TASKS), "mixed")


def register_task(task: Task) -> None:
    """Add (or replace) a task; for library users and tests."""
    if task.name == "mixed":
        raise ValueError("'mixed' is reserved")
    _TASKS[task.name] = task


def get_task(name: str) -> Task:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(task_names())}")
    return _TASKS[name]


def make_prompt(task: str, seed: int, step: int, prompt_id: int, encode=None, stream: str = "rl.prompts") -> Prompt:
    """`encode(text) -> ids` (default: the byte tokenizer); `stream` names the keyed stream (the
    RL run's prompts by default; another name gives prompts disjoint from the run's draws)."""
    rng = numpy_generator(seed, stream, step, prompt_id)
    name = MIXED[int(rng.integers(len(MIXED)))] if task == "mixed" else task
    spec = get_task(name)
    text = spec.make(rng)
    ids = None if encode is None else encode(f"{text} ")
    return Prompt(prompt_id, step, name, f"{text} ", spec.answer(text), ids)


def prompt_set(task: str, seed: int, step: int, count: int, encode=None) -> list[Prompt]:
    """The `count` prompts of step `step` (see the module docstring); `encode(text) -> ids` for a
    tokenizer other than the byte tokenizer."""
    if task != "mixed":
        get_task(task)
    return [make_prompt(task, seed, step, i, encode) for i in range(count)]


def completion_ids(tokens: list[int], eos_id: int) -> tuple[int, ...]:
    """The completion's token ids up to (without) the first EOS, as ints."""
    out = []
    for t in tokens:
        if t == eos_id:
            break
        out.append(int(t))
    return tuple(out)


def completion_text(tokens: list[int], tokenizer=TOKENIZER) -> str:
    """The completion's text: its tokens up to (without) the first EOS, decoded (special tokens
    skipped; the byte tokenizer drops ids >= 256)."""
    return tokenizer.decode(list(completion_ids(tokens, tokenizer.eos_id)), skip_special_tokens=True)


def score(prompt: Prompt, completion: str, sample_index: int) -> float:
    """The reward of one completion, checked (see the module docstring)."""
    spec = get_task(prompt.task)
    where = (
        f"task {prompt.task!r}, step {prompt.step}, prompt {prompt.id}, sample {sample_index} "
        f"(completion {completion!r})"
    )
    try:
        value = spec.reward(prompt.text.rstrip(" "), prompt.answer, completion)
    except Exception as error:  # a user reward function may raise anything
        raise RewardError(f"reward function raised for {where}: {type(error).__name__}: {error}") from error
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 <= value <= 1
    ):
        raise RewardError(f"reward function returned {value!r} (not a finite number in [0, 1]) for {where}")
    return float(value)


class BuiltinTask:
    """A built-in task as the RL loop sees it: the prompts of a step, a prompt group's rewards.
    `encode(text) -> ids` is the run's tokenizer (rl/user_task.py `RunTokenizer`)."""

    def __init__(self, name: str, seed: int, prompts_per_step: int, tokenizer, encode=None) -> None:
        self.name, self.seed, self.count = name, seed, prompts_per_step
        self.tokenizer, self.encode = tokenizer, encode
        self.inputs: dict | None = None  # nothing beyond the config to record in the manifest

    def prompts(self, step: int) -> list[Prompt]:
        return prompt_set(self.name, self.seed, step, self.count, self.encode)

    def score_group(self, prompt: Prompt, samples: list[tuple[int, list[int]]]) -> list[float]:
        """The rewards of a prompt's (sample index, completion tokens), checked by `score`."""
        return [score(prompt, completion_text(tokens, self.tokenizer), j) for j, tokens in samples]
