"""Synthetic verifiable-task corpora, generated from a seed, written as Parquet.

Tasks (each record: id, task, prompt, answer, text = prompt + " " + answer):
    arithmetic  "Compute: 37 + 58 =" -> "95"          (+, - or *, operands 0..99)
    reversal    "Reverse: lamp ->" -> "pmal"           (3..12 lowercase letters)
    sorting     "Sort: 5 31 9 ->" -> "5 9 31"          (3..8 integers 0..99, ascending)

Guarantees: record i is a pure function of (seed, i): its task and content come from the keyed
stream `numpy_generator(seed, "data.synthetic", 0, i)`, so any subset or order of ids can be
generated independently and the file's bytes depend on (seed, num_records, tasks,
row_group_size) alone. `solve(task, prompt)` recomputes the answer from the prompt alone (the
verifier rl/ rewards against); `is_correct(task, prompt, completion)` compares a model's
completion with it after stripping whitespace. The Parquet file is written atomically.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from titan_audit.atomic import atomic_output_file
from titan_audit.deterministic import numpy_generator

TASKS = ("arithmetic", "reversal", "sorting")
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


@dataclass(frozen=True)
class TaskRecord:
    id: int
    task: str
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return f"{self.prompt} {self.answer}"


@dataclass(frozen=True)
class SyntheticConfig:
    num_records: int
    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    row_group_size: int = 1024

    def __post_init__(self) -> None:
        if self.num_records < 1:
            raise ValueError(f"num_records must be >= 1, got {self.num_records}")
        if self.row_group_size < 1:
            raise ValueError(f"row_group_size must be >= 1, got {self.row_group_size}")
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TASKS)}")


def make_record(seed: int, index: int, tasks: tuple[str, ...] = TASKS) -> TaskRecord:
    rng = numpy_generator(seed, "data.synthetic", 0, index)
    task = tasks[int(rng.integers(len(tasks)))]
    if task == "arithmetic":
        a, b = (int(x) for x in rng.integers(0, 100, size=2))
        op = "+-*"[int(rng.integers(3))]
        prompt = f"Compute: {a} {op} {b} ="
    elif task == "reversal":
        word = "".join(rng.choice(_LETTERS, size=int(rng.integers(3, 13))))
        prompt = f"Reverse: {word} ->"
    else:
        values = rng.integers(0, 100, size=int(rng.integers(3, 9)))
        prompt = f"Sort: {' '.join(map(str, values.tolist()))} ->"
    return TaskRecord(index, task, prompt, solve(task, prompt))


def solve(task: str, prompt: str) -> str:
    """The correct answer, computed from the prompt alone."""
    if task == "arithmetic":
        match = re.fullmatch(r"Compute: (\d+) ([-+*]) (\d+) =", prompt)
        if not match:
            raise ValueError(f"not an arithmetic prompt: {prompt!r}")
        a, op, b = int(match[1]), match[2], int(match[3])
        return str(a + b if op == "+" else a - b if op == "-" else a * b)
    if task == "reversal":
        match = re.fullmatch(r"Reverse: ([a-z]+) ->", prompt)
        if not match:
            raise ValueError(f"not a reversal prompt: {prompt!r}")
        return match[1][::-1]
    if task == "sorting":
        match = re.fullmatch(r"Sort: ([\d ]+) ->", prompt)
        if not match:
            raise ValueError(f"not a sorting prompt: {prompt!r}")
        return " ".join(map(str, sorted(int(x) for x in match[1].split())))
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def is_correct(task: str, prompt: str, completion: str) -> bool:
    return completion.strip() == solve(task, prompt)


SCHEMA = pa.schema(
    [("id", pa.int64()), ("task", pa.string()), ("prompt", pa.string()), ("answer", pa.string()), ("text", pa.string())]
)


def write_synthetic_parquet(path: str | os.PathLike, config: SyntheticConfig, *, overwrite: bool = False) -> Path:
    """Generate the corpus and write it as one Parquet file with `row_group_size` rows per group."""
    path = Path(path)
    with atomic_output_file(path, overwrite=overwrite) as tmp:
        with pq.ParquetWriter(tmp, SCHEMA, compression="zstd") as writer:
            for start in range(0, config.num_records, config.row_group_size):
                records = [
                    make_record(config.seed, i, config.tasks)
                    for i in range(start, min(start + config.row_group_size, config.num_records))
                ]
                table = pa.table(
                    {
                        "id": [r.id for r in records],
                        "task": [r.task for r in records],
                        "prompt": [r.prompt for r in records],
                        "answer": [r.answer for r in records],
                        "text": [r.text for r in records],
                    },
                    schema=SCHEMA,
                )
                writer.write_table(table, row_group_size=config.row_group_size)
    return path
