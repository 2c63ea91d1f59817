"""The Recorder on our own decoder (titan_audit.models, tiny-dense): two runs compare identical
(G1 at every activation), and a one-ULP change in one layer's output is found there."""

import torch
from audit._audit_runs import one_ulp

from titan_audit.audit import Recorder, compare_runs, read_audit_log
from titan_audit.models import build

PRESET = "tiny-dense"


def _train(run_dir, perturb_module: str | None = None, steps: int = 2) -> list[str]:
    model = build(PRESET, seed=0)
    vocab = model.config.vocab_size
    if perturb_module is not None:

        def hook(_m, _i, out):
            if recorder.step == 1:
                mask = torch.zeros(out.shape, dtype=torch.bool)
                mask.view(-1)[0] = True
                return torch.where(mask, one_ulp(out), out)
            return None

        model.get_submodule(perturb_module).register_forward_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = Recorder(run_dir, model, level="full")
    for step in range(steps):
        recorder.start_step(step)
        recorder.set_microbatch(0)
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(step))
        recorder.record_data(ids)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        recorder.record_loss(loss)
        loss.backward()
        recorder.set_microbatch(-1)
        recorder.record_grads()
        opt.step()
        recorder.record_optimizer(opt)
        recorder.record_params()
        opt.zero_grad(set_to_none=True)
        recorder.end_step()
    recorder.close()
    return [name for name, _ in recorder.selected_modules(model)]


def test_tiny_dense_runs_compare_identical_and_find_a_perturbed_layer(tmp_path):
    modules = _train(tmp_path / "a")
    _train(tmp_path / "b")
    result = compare_runs(tmp_path / "a", tmp_path / "b")
    assert result.identical and result.compared > 200
    rows = read_audit_log(tmp_path / "a").to_pylist()
    forward = {r["name"] for r in rows if r["phase"] == "forward" and r["step"] == 0}
    # models/ calls its projections' weights through ops.linear, not the nn.Linear modules, so only
    # the modules that are called (norms, attention, mlp, layers, the root) have forward records
    # (the embedding is indexed directly too)
    assert {"<root>", "layers.0", "layers.0.self_attn", "layers.3.mlp", "norm"} <= forward
    assert forward <= set(modules)
    target = "layers.1.mlp"
    _train(tmp_path / "c", perturb_module=target)
    first = compare_runs(tmp_path / "a", tmp_path / "c").first_divergence
    assert (first["step"], first["phase"], first["name"]) == (1, "forward", target)
