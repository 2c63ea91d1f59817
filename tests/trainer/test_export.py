"""`titan-audit export`: a run's checkpoint as an HF directory that transformers loads with our
logits (within the HF parity tolerance; the previous checkpoint's logits are the negative
control), that `from_pretrained` and `train --init` read back bitwise, written atomically; a
missing step, an occupied --out and a damaged checkpoint are one-line errors with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from trainer._init_runs import ATOL, QUICK, VOCAB, cli, ok, one_line_error, save_hf_qwen3

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Two steps of tiny-dense from a transformers Qwen3 of another vocab size (checkpoints 1, 2)."""
    root = tmp_path_factory.mktemp("export")
    hf = save_hf_qwen3(root / "hf")
    out = root / "run"
    ok(cli("train", "--config", "tiny-dense", "--init", hf, "--out", out, "--steps", "2", *QUICK))
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("exported") / "hf"
    proc = ok(cli("export", run, "--out", out, "--json"))
    return out, json.loads(proc.stdout)


def ours_at(run: Path, step: int):
    from titan_audit.models import build
    from titan_audit.trainer.config import ModelSection
    from titan_audit.trainer.init import load_checkpoint

    manifest = json.loads((run / "manifest.json").read_text())
    model = build(ModelSection(**manifest["config"]["model"]).model_config())
    load_checkpoint(run, step, model, portable=False)
    return model.eval()


def test_transformers_loads_the_export_with_our_logits(run, exported):
    out, result = exported
    assert result == {
        "path": str(out),
        "run": str(run),
        "step": 2,
        "files": ["config.json", "generation_config.json", "model.safetensors"],
        "weights": result["weights"],
    }
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.vocab_size == VOCAB
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 256  # the byte tokenizer's
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
        diff = (theirs - ours_at(run, 2)(tokens)).abs().max().item()
        control = (theirs - ours_at(run, 1)(tokens)).abs().max().item()
    assert diff < ATOL, diff
    assert control > 100 * ATOL, control  # negative control: another checkpoint's logits are far off


def test_the_export_reads_back_bitwise_and_starts_a_run_with_its_digest(run, exported, tmp_path):
    from titan_audit.models import from_pretrained
    from titan_audit.trainer.init import weights_digest

    out, result = exported
    ours = ours_at(run, 2)
    back = from_pretrained(out)
    assert weights_digest(back) == weights_digest(ours) == result["weights"]
    again = tmp_path / "again"
    ok(cli("train", "--config", "tiny-dense", "--init", out, "--out", again, "--steps", "1", *QUICK))
    assert json.loads((again / "manifest.json").read_text())["init"]["weights"] == result["weights"]


def test_an_unknown_step_lists_the_available_ones(run, tmp_path):
    out = tmp_path / "hf"
    one_line_error(cli("export", run, "--step", "7", "--out", out), r"no checkpoint at step 7; available steps: 1, 2")
    assert not out.exists()
    ok(cli("export", run, "--step", "1", "--out", out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"


def test_an_occupied_out_is_refused_unless_overwrite(run, exported, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    one_line_error(cli("export", run, "--out", out), r"--out .*: is not empty; use --overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    one_line_error(cli("export", run, "--out", run / "hf", "--overwrite"), r"inside the run .*outside any run")
    assert not (run / "hf").exists()
    ok(cli("export", run, "--out", out, "--overwrite"))  # the old one moved aside, as for runs
    assert sorted(p.name for p in out.iterdir()) == exported[1]["files"]
    (aside,) = tmp_path.glob("hf.replaced-*")
    assert (aside / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", aside.name])  # no temporaries left


def test_a_damaged_checkpoint_is_refused_and_nothing_is_written(run, tmp_path):
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    weight = ours_at(run, 2).embed_tokens.weight.detach().numpy().tobytes()
    data = damaged / "checkpoints" / "step_00000002" / "model_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    at = raw.find(weight)
    assert at >= 0, "the weight's bytes are not in the checkpoint file"
    raw[at + 5] ^= 0x01  # one bit of one weight
    data.write_bytes(bytes(raw))
    out = tmp_path / "hf"
    one_line_error(
        cli("export", damaged, "--out", out),
        r"step_00000002: 1 tensor\(s\) do not match hashes\.json, first model\.embed_tokens\.weight",
    )
    assert not out.exists()
