"""The real-width bench cases (train, generate) build the widths of qwen3-0.6b with 2 layers and
are left out of `--quick` (their runs take tens of seconds; `bench train` / `bench generate` run them)."""

from __future__ import annotations

from titan_audit.bench import generate_suite, train_suite
from titan_audit.models.presets import get_preset
from titan_audit.trainer.config import load_config

QWEN3_06B = get_preset("qwen3-0.6b")


def widths(config) -> tuple:
    return (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.tie_word_embeddings,
    )


def test_train_real_width_config():
    config = load_config("tiny-dense", [*train_suite.REAL_WIDTH, *train_suite.REAL_WIDTH_SIDES[train_suite.BI]])
    model = config.model.model_config()
    assert widths(model) == widths(QWEN3_06B) and model.num_hidden_layers == 2
    assert (config.data.seq_len, config.data.global_batch_size, config.data.num_microbatches) == (64, 2, 2)
    assert config.determinism.batch_invariant
    native = load_config(
        "tiny-dense", [*train_suite.REAL_WIDTH, *train_suite.REAL_WIDTH_SIDES[train_suite.DETERMINISTIC]]
    )
    assert native.determinism.enabled and not native.determinism.batch_invariant  # the baseline: native ops
    assert train_suite.TARGET_BI_RATIO == 1.2


def test_generate_real_width_config():
    model = generate_suite.real_width_config()
    assert widths(model) == widths(QWEN3_06B) and model.num_hidden_layers == 2
    assert widths(model) != widths(get_preset("tiny-dense"))  # control: not the tiny widths


def test_quick_runs_leave_the_real_width_cases_out(monkeypatch):
    """--quick never reaches the real-width part: the train suite returns after its tiny cases."""
    from titan_audit.bench.core import BenchOptions

    calls = []

    def fake_step_seconds(overrides, steps, root, name, world_size=train_suite.WORLD_SIZE):
        calls.append((tuple(overrides), world_size))
        return 1.0, 128

    monkeypatch.setattr(train_suite, "_step_seconds", fake_step_seconds)
    cases = train_suite.train_suite(BenchOptions(quick=True, repeats=1), lambda _: None)
    assert [c.case.split(":")[0] for c in cases] == ["train tiny-dense W=2 V=8"] * 4  # three DP, one FSDP2
    assert all(world == train_suite.WORLD_SIZE for _, world in calls)
    calls.clear()
    cases = train_suite.train_suite(BenchOptions(quick=False, repeats=1), lambda _: None)
    assert cases[-1].case == f"{train_suite.REAL_WIDTH_CASE}: {train_suite.BI}" and cases[-1].target == 1.2
    real = [c for c in calls if c[1] == train_suite.REAL_WIDTH_WORLD_SIZE]
    assert len(real) == 2 and all(set(train_suite.REAL_WIDTH) <= set(o) for o, _ in real)
