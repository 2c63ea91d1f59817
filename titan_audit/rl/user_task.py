"""Your own RL task: a prompts file, reward functions of TRL's signature, and an HF tokenizer.

    task = build_task(config)                    # BuiltinTask (rl/tasks.py) or UserTask
    prompts = task.prompts(step)                 # the step's P prompts, prompt ids 0 .. P-1
    rewards = task.score_group(prompt, [(j, completion_tokens), ...])   # one float per sample
    # a reward function: fn(prompts, completions, completion_ids, trainer_state, **columns), as in TRL

Config (rl/config.py TaskSection, TokenizerSection):
    task.prompts = "prompts.jsonl"   # or .parquet; one prompt a row in column task.prompt_column
    task.reward = "my_rewards:exact_match"          # or "path/to/file.py:fn"; or several:
    task.rewards = ["my_rewards:exact", "my_rewards:short"]; task.reward_weights = [1.0, 0.5]
    tokenizer.path = "tokenizer.json"               # or an HF tokenizer directory (chat templates)

Guarantees:
- The prompts of step k are a pure function of (seed, k, the file): prompt i of step k is the
  row of global position g = (k-1)*P + i; epoch e = g // N walks the N rows in the order of a
  keyed permutation of [0, N) (data/permutation.py, keyed (seed, "rl.prompt_order", e)), or in
  file order with task.shuffle = false. So any rank at any world size builds the same prompts.
  Every row is checked when the task is built: the prompt column is a non-empty string (or, with
  tokenizer.chat_template, a list of {"role", "content"} messages), its tokens + max_new_tokens
  fit the model's context; errors name the file and the row.
- A reward function is called once per prompt group as TRL's GRPOTrainer calls it:
  fn(prompts=[prompt] * G, completions=[text of each sample], completion_ids=[ids of each sample],
  trainer_state=RewardState(...), **{column: [value] * G for every other column}), where a
  completion's ids are its tokens before the first EOS (fresh lists of ints), its text those ids
  decoded with special tokens skipped, `prompt` the row's prompt as the file holds it (before any
  chat template), and `trainer_state` a frozen `RewardState` (global_step = step - 1, the
  optimizer steps done before this one, as TRL counts; step; max_steps = the config's `steps`: a
  resume that changes `steps` changes it). completion_ids and trainer_state are passed only to a
  function that takes them (a **kwargs parameter or a parameter of that name, read from its
  signature once), so a function written without them keeps working. It must return G values, each
  a finite real number (not a bool) or None ("not applicable", as in TRL); the sample's reward is
  sum_i weight_i * fn_i over the functions that gave it a number (TRL's nansum: None counts as
  nothing; float64, then float32). A sample for which every function returned None is refused
  (RewardError): TRL leaves such a sample out of its group's mean and std and gives it advantage
  0, which the GRPO loss here does not do. A function that raises (the first sample that raises
  alone is named), returns the wrong length or a bad value stops the run with RewardError naming
  the function, the step, the prompt id, its row and the sample index. With task.reward_check the
  first group a rank scores in a step is scored twice, and a bit difference (None included) is a
  NondeterministicRewardError naming the function and the sample.
- `inputs` (recorded in the manifest as `task_inputs`) holds the prompts file's path, row count
  and xxh3-128 digest, each reward function's spec, source file and the digest of that file (the
  module's own file: not what it imports), and the tokenizer's identity; a resume whose inputs
  differ is refused naming the one that changed (`input_differences`).
- With an HF tokenizer its vocabulary, EOS and PAD ids must fit the model: a ValueError says which
  does not and the key to set (`build_tokenizer`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import numbers
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from titan_audit.data.permutation import ROUNDS, FeistelPermutation
from titan_audit.data.textio import decode_utf8
from titan_audit.data.tokenizer import ByteTokenizer, load_tokenizer
from titan_audit.deterministic import numpy_generator
from titan_audit.rl.tasks import (
    TOKENIZER,
    BuiltinTask,
    NondeterministicRewardError,
    Prompt,
    RewardError,
    completion_ids,
    completion_text,
)

USER_TASK = "prompts"  # Prompt.task of the user's prompts


# ---------------------------------------------------------------------------------- tokenizer
@dataclass
class RunTokenizer:
    """The run's tokenizer and how a prompt becomes ids (with or without the chat template)."""

    tokenizer: Any  # ByteTokenizer | HFTokenizer | PretrainedTokenizer
    chat_template: bool = False

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def text(self, prompt: str | list) -> str:
        return self.tokenizer.chat_prompt(prompt) if self.chat_template else prompt

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokenizer.encode_batch([text])[0])


def build_tokenizer(config) -> RunTokenizer:
    """The byte tokenizer, or `tokenizer.path`'s, checked against `model.vocab_size` (ValueError
    naming the key that does not fit and what to set)."""
    section, vocab = config.tokenizer, config.model.model_config().vocab_size
    if section.path is None:
        if vocab < TOKENIZER.vocab_size:
            raise ValueError(f"model vocab_size {vocab} < the byte tokenizer's {TOKENIZER.vocab_size}")
        return RunTokenizer(TOKENIZER)
    try:
        tokenizer = load_tokenizer(section.path, section.eos_token, section.pad_token)
    except ValueError as error:
        hint = "" if "eos" not in str(error) and "pad" not in str(error) else " (set tokenizer.eos_token / pad_token)"
        raise ValueError(f"tokenizer.path: {error}{hint}") from None
    where = f"tokenizer.path {section.path}"
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"{where}: its vocabulary of {tokenizer.vocab_size} tokens is larger than model.vocab_size {vocab}; "
            f"set model.overrides.vocab_size >= {tokenizer.vocab_size} (or use a model of that vocabulary)"
        )
    for key, token_id in (("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id)):
        if not 0 <= token_id < vocab:
            raise ValueError(
                f"{where}: its {key.split('_')[0].upper()} id {token_id} is outside the model's vocabulary "
                f"[0, {vocab}); set tokenizer.{key} to a token with a smaller id"
            )
    if section.chat_template and not getattr(tokenizer, "has_chat_template", False):
        raise ValueError(
            f"{where}: tokenizer.chat_template = true needs an HF tokenizer directory with a chat template "
            f"(tokenizer_config.json 'chat_template'); this one has none"
        )
    return RunTokenizer(tokenizer, section.chat_template)


# ---------------------------------------------------------------------------------- prompts file
def file_digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl (one JSON object a line; blank lines skipped) or .parquet file."""
    if not path.is_file():
        raise ValueError(f"task.prompts {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as error:
            raise ValueError(f"task.prompts {path}: not a readable Parquet file ({error})") from None
    if path.suffix != ".jsonl":
        raise ValueError(f"task.prompts {path}: expected a .jsonl or .parquet file")
    rows = []
    for number, line in enumerate(decode_utf8(path.read_bytes(), path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg}: column {error.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def prompt_rows(seed: int, step: int, count: int, n_rows: int, shuffle: bool) -> list[int]:
    """The rows of step `step`'s `count` prompts (see the module docstring)."""
    rows, permutations = [], {}
    for i in range(count):
        epoch, position = divmod((step - 1) * count + i, n_rows)
        if not shuffle:
            rows.append(position)
            continue
        if epoch not in permutations:
            rng = numpy_generator(seed, "rl.prompt_order", epoch, 0)
            keys = rng.integers(0, np.iinfo(np.uint64).max, size=ROUNDS, dtype=np.uint64, endpoint=True)
            permutations[epoch] = FeistelPermutation(n_rows, keys)
        rows.append(int(permutations[epoch](position)[0]))
    return rows


def _check_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    )


# ---------------------------------------------------------------------------------- rewards
@dataclass(frozen=True)
class RewardState:
    """What a reward function sees of the run as `trainer_state` (read-only): global_step is the
    number of optimizer steps done before this step's update (TRL's TrainerState.global_step
    while it scores that step's completions), step the RL step (1-based), max_steps the config's
    `steps`."""

    global_step: int
    step: int
    max_steps: int


OPTIONAL_ARGUMENTS = ("completion_ids", "trainer_state")  # passed only to a function that takes them


@dataclass
class RewardFunction:
    spec: str
    fn: Any
    source: str
    digest: str
    takes: frozenset[str] = frozenset(OPTIONAL_ARGUMENTS)  # the optional arguments its signature accepts


def accepted_arguments(fn: Any) -> frozenset[str]:
    """Which of OPTIONAL_ARGUMENTS `fn` accepts: all with a **kwargs parameter, else those it names
    (keyword-passable); all when its signature cannot be read (TRL passes them unconditionally)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset(OPTIONAL_ARGUMENTS)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(OPTIONAL_ARGUMENTS)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in keyword and p.name in OPTIONAL_ARGUMENTS)


def load_reward(spec: str) -> RewardFunction:
    """'module:function' (importable) or '/path/to/file.py:function' (config.py makes it absolute)."""
    where, _, name = spec.rpartition(":")
    key = f"task.reward {spec!r}"
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{key}: no such file {path}")
        module_name = f"titan_audit_user_reward_{xxhash.xxh3_64_hexdigest(str(path).encode())}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as error:  # the user's module may raise anything on import
            raise ValueError(f"{key}: importing {path} raised {type(error).__name__}: {error}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"{key}: cannot import module {where!r} ({error})") from None
        except Exception as error:
            raise ValueError(f"{key}: importing {where!r} raised {type(error).__name__}: {error}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}: module {module.__name__!r} has no function {name!r}")
    try:
        source = Path(inspect.getsourcefile(module) or "")
    except TypeError:
        source = Path("")
    if not source.is_file():
        raise ValueError(f"{key}: module {module.__name__!r} has no source file to record")
    return RewardFunction(spec, fn, str(source.resolve()), file_digest(source), accepted_arguments(fn))


def _bits(value: float | None) -> bytes:
    return b"None" if value is None else struct.pack("<d", value)


# ---------------------------------------------------------------------------------- the task
class UserTask:
    """The user's prompts file and reward functions as the RL loop sees them (module docstring)."""

    def __init__(self, config, tokenizer: RunTokenizer) -> None:
        task = config.task
        self.seed, self.count, self.shuffle = config.seed, task.prompts_per_step, task.shuffle
        self.tokenizer, self.run_tokenizer = tokenizer.tokenizer, tokenizer
        self.check = task.reward_check
        self.path = Path(task.prompts)
        digest = file_digest(self.path) if self.path.is_file() else None
        rows = read_rows(self.path)
        if not rows:
            raise ValueError(f"task.prompts {self.path}: no rows")
        column = task.prompt_column
        self.columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c != column]
        context = config.model.model_config().max_position_embeddings
        max_new = config.sampling.max_new_tokens
        self.raw, self.texts, self.ids, self.extra = [], [], [], []
        for r, row in enumerate(rows):
            where = f"task.prompts {self.path} row {r}"
            value = row.get(column)
            if _check_messages(value) and not tokenizer.chat_template:
                raise ValueError(f"{where}: a list of messages needs tokenizer.chat_template = true")
            if not (isinstance(value, str) and value) and not _check_messages(value):
                raise ValueError(
                    f"{where}: column {column!r} is {value!r}, not a non-empty string (task.prompt_column)"
                )
            text = tokenizer.text(value)
            ids = tokenizer.encode(text)
            if not ids:
                raise ValueError(f"{where}: the prompt has no tokens")
            if len(ids) + max_new > context:
                raise ValueError(
                    f"{where}: {len(ids)} prompt tokens + sampling.max_new_tokens {max_new} exceed the model's "
                    f"context (max_position_embeddings {context})"
                )
            self.raw.append(value)
            self.texts.append(text)
            self.ids.append(ids)
            self.extra.append({c: row.get(c) for c in self.columns})
        self.max_steps = config.steps
        self.rewards = [load_reward(spec) for spec in task.reward_specs]
        self.weights = task.weights
        self.inputs = {
            "prompts": {"path": str(self.path), "rows": len(rows), "xxh3": digest},
            "rewards": [{"spec": r.spec, "source": r.source, "xxh3": r.digest} for r in self.rewards],
            "tokenizer": getattr(self.tokenizer, "identity", None),
        }
        self._checked_steps: set[int] = set()

    def prompts(self, step: int) -> list[Prompt]:
        rows = prompt_rows(self.seed, step, self.count, len(self.ids), self.shuffle)
        return [Prompt(i, step, USER_TASK, self.texts[r], "", self.ids[r], r) for i, r in enumerate(rows)]

    def score_group(self, prompt: Prompt, samples: list[tuple[int, list[int]]]) -> list[float]:
        """The weighted rewards of a prompt group (see the module docstring)."""
        indices = [j for j, _ in samples]
        ids = [completion_ids(tokens, self.tokenizer.eos_id) for _, tokens in samples]
        completions = [completion_text(tokens, self.tokenizer) for _, tokens in samples]
        group = _Group(prompt, indices, completions, ids)
        check = self.check and prompt.step not in self._checked_steps
        self._checked_steps.add(prompt.step)
        totals: list[float | None] = [None] * len(samples)  # None: no function has scored it yet
        for reward, weight in zip(self.rewards, self.weights):
            values = self._call(reward, group)
            if check:
                again = self._call(reward, group)
                for j, a, b in zip(indices, values, again):
                    if _bits(a) != _bits(b):
                        raise NondeterministicRewardError(
                            f"reward {reward.spec!r} is nondeterministic: {self._where(prompt, j)} scored {a!r}, "
                            f"then {b!r} on the same input (task.reward_check); a reward must be a pure function "
                            f"of (prompts, completions, completion_ids, trainer_state, columns)"
                        )
            totals = [t if v is None else (t or 0.0) + weight * v for t, v in zip(totals, values)]
        for j, completion, total in zip(indices, completions, totals):
            if total is None:
                names = ", ".join(repr(r.spec) for r in self.rewards)
                raise RewardError(
                    f"every reward function ({names}) returned None for {self._where(prompt, j)} (completion "
                    f"{completion!r}): a sample needs a number from at least one of them (TRL would leave it out "
                    f"of its group's mean and std with advantage 0; this GRPO loss does not)"
                )
        return totals

    def _where(self, prompt: Prompt, sample: int) -> str:
        return f"step {prompt.step}, prompt {prompt.id} (row {prompt.row} of {self.path.name}), sample {sample}"

    def _arguments(self, reward: RewardFunction, group: _Group, only: int | None = None) -> dict[str, Any]:
        """The keyword arguments of one call: fresh lists (a function that edits them changes
        nothing else), of the whole group or of its sample at position `only`."""
        prompt, row = group.prompt, group.prompt.row
        keep = range(len(group.indices)) if only is None else [only]
        n = len(keep)
        args: dict[str, Any] = {"prompts": [self.raw[row]] * n, "completions": [group.completions[k] for k in keep]}
        if "completion_ids" in reward.takes:
            args["completion_ids"] = [list(group.ids[k]) for k in keep]
        if "trainer_state" in reward.takes:
            args["trainer_state"] = RewardState(prompt.step - 1, prompt.step, self.max_steps)
        args.update({c: [self.extra[row][c]] * n for c in self.columns})
        return args

    def _call(self, reward: RewardFunction, group: _Group) -> list[float | None]:
        prompt, indices, completions = group.prompt, group.indices, group.completions
        try:
            values = reward.fn(**self._arguments(reward, group))
        except Exception as error:  # a user reward function may raise anything
            sample = self._first_raising(reward, group)
            where = self._where(prompt, sample) if sample is not None else self._where(prompt, indices[0]) + " .."
            raise RewardError(
                f"reward {reward.spec!r} raised for {where} (completion "
                f"{completions[indices.index(sample)] if sample is not None else completions[0]!r}): "
                f"{type(error).__name__}: {error}"
            ) from error
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward {reward.spec!r} returned {got} for {self._where(prompt, indices[0])} .. (a group of "
                f"{len(completions)} completions): expected a list of {len(completions)} floats"
            )
        out: list[float | None] = []
        for j, completion, value in zip(indices, completions, values):
            if value is None:  # "not applicable to this sample" (TRL)
                out.append(None)
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(
                    f"reward {reward.spec!r} returned {value!r} (not a finite number) for "
                    f"{self._where(prompt, j)} (completion {completion!r}); a reward is a real number or None"
                )
            out.append(float(value))
        return out

    def _first_raising(self, reward: RewardFunction, group: _Group) -> int | None:
        """The first sample whose reward raises when scored alone (None: only the group raises)."""
        for k, j in enumerate(group.indices):
            try:
                reward.fn(**self._arguments(reward, group, only=k))
            except Exception:  # noqa: BLE001 - the one we are looking for
                return j
        return None


@dataclass(frozen=True)
class _Group:
    """A prompt group as the reward functions see it: sample indices, texts and token ids."""

    prompt: Prompt
    indices: list[int]
    completions: list[str]
    ids: list[tuple[int, ...]]


def build_task(config) -> BuiltinTask | UserTask:
    """The run's task: the user's (task.prompts set) or the built-in `task.name`, on the run's
    tokenizer. Every ValueError names the key or file at fault."""
    tokenizer = build_tokenizer(config)
    if config.task.prompts is not None:
        return UserTask(config, tokenizer)
    byte = isinstance(tokenizer.tokenizer, ByteTokenizer) and not tokenizer.chat_template
    encode = None if byte else (lambda text: tokenizer.encode(tokenizer.text(text)))
    task = BuiltinTask(config.task.name, config.seed, config.task.prompts_per_step, tokenizer.tokenizer, encode)
    if not byte:
        task.inputs = {"tokenizer": tokenizer.tokenizer.identity}
    return task


def input_differences(saved: dict | None, current: dict | None) -> list[str]:
    """What changed in the task's inputs since the run started (manifest `task_inputs`)."""
    saved, current = saved or {}, current or {}
    out = []
    a, b = saved.get("prompts") or {}, current.get("prompts") or {}
    if a != b:
        out.append(
            f"the prompts file {b.get('path') or a.get('path')} changed (xxh3 {a.get('xxh3')} -> {b.get('xxh3')})"
        )
    for x, y in zip(saved.get("rewards") or [], current.get("rewards") or []):
        if x != y:
            out.append(f"the reward module {y['source']} of {y['spec']!r} changed (xxh3 {x['xxh3']} -> {y['xxh3']})")
    if len(saved.get("rewards") or []) != len(current.get("rewards") or []):
        out.append("the reward functions changed")
    if saved.get("tokenizer") != current.get("tokenizer"):
        out.append(f"the tokenizer changed ({saved.get('tokenizer')} -> {current.get('tokenizer')})")
    return out
