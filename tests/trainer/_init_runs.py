"""Test helpers for `train --init` and `export`: a tiny transformers-saved Qwen3 whose shape is not
any preset's, and the CLI run in this process (tiny runs: no interpreter start-up per call)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

ATOL = 2e-5  # the HF parity tolerance (tests/models/test_hf_parity.py): float32, O(1) logits
VOCAB = 512  # the recipes' tiny-dense has 2048; the byte tokenizer needs >= 258
QUICK = ["--set", "data.synthetic_records=256", "--set", "checkpoint.interval=1"]


def save_hf_qwen3(path: Path) -> Path:
    """A random transformers Qwen3ForCausalLM (norm weights perturbed, as in the parity tests),
    saved with transformers' own save_pretrained."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
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


def one_line_error(proc: subprocess.CompletedProcess, pattern: str) -> str:
    """Exit 2 with one line on stderr, 'Error: ...', matching `pattern`; the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]
