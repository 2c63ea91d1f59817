"""The audit record schema (DESIGN.md section 3) and the execution order of phases.

Guarantees:
- `SCHEMA` holds DESIGN.md's columns exactly, in its order and with its types: step int64,
  phase str, microbatch int32, name str, dtype str, shape str, hash str, absmax float64,
  mean float64, rank int32. One extra column follows them: `seq int64`, the execution ordinal of
  the record within its (step, microbatch) on the rank that recorded it. It is what lets
  `compare` order records of one phase (a module's forward outputs, say) by execution. It does
  not depend on the world size: a microbatch is processed whole by one rank, and step-level
  records (microbatch -1) are recorded in a fixed order by the code that drives the Recorder.
- `KEY` is the comparison key (step, phase, microbatch, name); `rank` and `seq` are not in it,
  so runs on different world sizes compare.
- `PHASES` lists the phases in execution order within a step. DESIGN.md names the phases; the
  order of most is fixed by the design (data < forward < loss < backward < grad < optim < param <
  ckpt). The two it leaves open are placed where they happen in RL post-training:
  `rollout` first (the generator produces the samples that become the step's data), and
  `logprob` between `forward` and `loss` (log-probs are computed from the forward logits and
  feed the loss).
"""

from __future__ import annotations

import pyarrow as pa

PHASES: tuple[str, ...] = (
    "rollout",
    "data",
    "forward",
    "logprob",
    "loss",
    "backward",
    "grad",
    "optim",
    "param",
    "ckpt",
)
PHASE_RANK: dict[str, int] = {phase: i for i, phase in enumerate(PHASES)}

KEY: tuple[str, ...] = ("step", "phase", "microbatch", "name")

# DESIGN.md's columns, exactly; then the extra execution-order column.
DESIGN_COLUMNS: tuple[str, ...] = (
    "step",
    "phase",
    "microbatch",
    "name",
    "dtype",
    "shape",
    "hash",
    "absmax",
    "mean",
    "rank",
)
EXTRA_COLUMNS: tuple[str, ...] = ("seq",)

SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("microbatch", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("shape", pa.string(), nullable=False),
        pa.field("hash", pa.string(), nullable=False),
        pa.field("absmax", pa.float64()),
        pa.field("mean", pa.float64()),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
    ],
    metadata={b"titan-audit.audit-log": b"1"},
)

assert tuple(SCHEMA.names) == DESIGN_COLUMNS + EXTRA_COLUMNS


def check_phase(phase: str) -> str:
    """`phase` if it is one of PHASES, else ValueError naming the known phases."""
    if phase not in PHASE_RANK:
        raise ValueError(f"unknown audit phase {phase!r}; known phases: {', '.join(PHASES)}")
    return phase
