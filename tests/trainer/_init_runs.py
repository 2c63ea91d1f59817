"""Test helpers for `train --init` and `export`: a tiny transformers-saved Qwen3 whose shape is not
any preset's, and the CLI run in this process (tiny runs: no interpreter start-up per call)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from command_line import one_line_error  # noqa: F401  (the init and export tests import it from here)
from hf_models import ATOL, COMMON, hf_model  # noqa: F401  (ATOL: the export test imports it from here)

VOCAB = 512  # the recipes' tiny-dense has 2048; the byte tokenizer needs >= 258
QUICK = ["--set", "data.synthetic_records=256", "--set", "checkpoint.interval=1"]


def save_hf_qwen3(path: Path) -> Path:
    """A random transformers Qwen3ForCausalLM (norm weights perturbed, as in the parity tests),
    saved with transformers' own save_pretrained."""
    import transformers

    config = transformers.Qwen3Config(
        **{**COMMON, "vocab_size": VOCAB},
        intermediate_size=96,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = hf_model(transformers.Qwen3ForCausalLM, config)
    model.save_pretrained(path)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    """`titan-audit ARGS` in this process (the runs here are a few tiny steps)."""
    from click.testing import CliRunner

    from titan_audit.cli.main import cli as group

    result = CliRunner().invoke(group, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
