"""`titan-audit rl` and `titan-audit verify-onpolicy`: bad input is one line + exit 2 with nothing
written; the report exists, is self-contained, and the exit code is the zero-gap verdict."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from command_line import cli, cli_here, one_line_error

TINY = ["--set", "task.prompts_per_step=2", "--set", "task.samples_per_prompt=2", "--set", "sampling.max_new_tokens=4"]


@pytest.fixture(scope="module")
def other_shape(tmp_path_factory) -> Path:
    """An HF directory holding a 2-layer tiny-dense (another shape than rl-tiny's model)."""
    import dataclasses

    from titan_audit.models import build, get_preset, save_pretrained

    out = tmp_path_factory.mktemp("hf") / "two-layers"
    save_pretrained(build(dataclasses.replace(get_preset("tiny-dense"), num_hidden_layers=2)), out)
    return out


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--set", 'task.name="nope"'], r"task\.name: unknown task 'nope'"),
        (
            ["--set", "rollout.lag=3", "--set", "rollout.buffer=2"],
            r"rollout\.lag = 3 is larger than rollout\.buffer = 2",
        ),
        (["--set", "sampling.temperature=0"], r"sampling\.temperature must be a finite number > 0"),
        (["--set", "sampling.temperature=-1.5"], r"sampling\.temperature"),
        (["--set", "model.overrides.max_position_embeddings=24"], r"prompt \d+ .*exceed the model's context"),
        (
            ["--set", "task.prompts_per_step=3", "--nproc", "2"],
            r"world size 2 does not divide task\.prompts_per_step = 3",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, extra, pattern):
    out = tmp_path / "run"
    one_line_error(cli_here("rl", "--config", "rl-tiny", "--out", str(out), *extra), pattern)
    assert not out.exists()


def test_init_of_another_shape_gives_the_run_its_shape(tmp_path, other_shape):
    """The config's model takes the init's shape (trainer/init.py); a model key set against it is refused."""
    from titan_audit.models import from_pretrained
    from titan_audit.trainer.init import weights_digest

    out = tmp_path / "run"
    one_line_error(
        cli_here(
            "rl",
            "--config",
            "rl-tiny",
            "--out",
            str(out),
            "--init",
            str(other_shape),
            "--set",
            "model.overrides.num_hidden_layers=4",
        ),
        r"model\.overrides\.num_hidden_layers = 4 contradicts --init .*: its model has num_hidden_layers = 2",
    )
    assert not out.exists()
    one_line_error(
        cli_here("rl", "--config", "rl-tiny", "--out", str(out), "--init", str(tmp_path)),
        r"neither a run directory .* nor an HF model directory",
    )
    done = cli_here("rl", "--config", "rl-tiny", "--out", str(out), "--init", str(other_shape), "--steps", "1", *TINY)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["model"]["overrides"] == {"num_hidden_layers": 2}
    assert manifest["init"]["kind"] == "hf"
    assert manifest["init"]["weights"] == weights_digest(from_pretrained(other_shape))


def test_an_existing_run_is_never_overwritten_and_resume_needs_a_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    one_line_error(cli_here("rl", "--config", "rl-tiny", "--out", str(out), *TINY), r"is not empty; use --resume")
    assert (out / "keep.txt").read_text() == "precious" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    one_line_error(
        cli_here("rl", "--out", str(tmp_path / "none"), "--resume"), r"no such run directory|not a run directory"
    )


def _verify_onpolicy(out: Path, *extra: str) -> dict:
    """verify-onpolicy of rl-tiny (TINY, 2 steps) with the constructed control and the native-ops
    run; its JSON verdict."""
    args = ["--config", "rl-tiny", "--steps", "2", "--out", str(out), "--control", "--compare-default", "--json"]
    proc = cli("verify-onpolicy", *args, *TINY, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_verify_onpolicy_report_and_verdict(tmp_path):
    out = tmp_path / "v"
    verdict = _verify_onpolicy(out)
    assert verdict["zero_gap"] is True and verdict["tokens_compared"] > 0 and verdict["tokens_differing"] == 0
    # negative control: the generator sent weights one ulp off shows a gap, and the report says so
    control = verdict["control"]
    assert control["shows_gap"] is True and control["tokens_differing"] > 0 and verdict["passed"] is True
    assert control["run"] == str(out / "control") and control["control"] == "generator-weight-ulp"
    assert control["tokens_compared"] == verdict["tokens_compared"]
    # native ops: reported with the same keys, part of no verdict (whether they differ depends on the CPU)
    assert set(verdict["default"]) == {"tokens_compared", "tokens_differing", "steps_with_gap", "max_abs_diff"}
    md = (out / "reports" / "onpolicy.md").read_text()
    page = (out / "reports" / "onpolicy.html").read_text()
    assert "ZERO GAP" in md and "CONTROL SHOWS A GAP" in md and "Native ops, reported only" in md
    assert "## Per step, constructed control" in md and "## Per step, native ops" in md
    assert page.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=['\"](https?:|//|file:)", page)  # self-contained
    assert "rolling mean over 10 steps" in page
    _assert_reward_plot_draws_rolling_means(out, out / "compare-default", out / "control")
    _render_in_chromium(out / "reports" / "onpolicy.html", tmp_path)


def test_verify_onpolicy_fails_when_the_control_shows_no_gap(tmp_path, monkeypatch):
    """The verdict's control can fail: with the perturbation replaced by the identity, the control
    run's generator holds the trainer's weights, shows no gap, and the verification does not pass."""
    from titan_audit.rl import rollout_schedule
    from titan_audit.rl.verify import verify_onpolicy

    monkeypatch.setattr(rollout_schedule, "generator_weights", lambda weights, control: weights)
    overrides = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "sampling.max_new_tokens=4"]
    result = verify_onpolicy("rl-tiny", tmp_path / "v", steps=1, overrides=overrides, quiet=True, control=True)
    assert result.rc == 0 and result.verdict["zero_gap"] is True
    assert result.verdict["control"]["shows_gap"] is False and result.verdict["control"]["tokens_compared"] > 0
    assert result.passed is False and result.verdict["passed"] is False
    assert "CONTROL SHOWS NO GAP" in (tmp_path / "v" / "reports" / "onpolicy.md").read_text()


def test_verify_onpolicy_refuses_a_bad_control_value(tmp_path):
    out = tmp_path / "bad"
    proc = cli_here("verify-onpolicy", "--config", "rl-tiny", "--steps", "1", "--out", out, "--set", "control=nope")
    one_line_error(proc, r"control: 'nope' is not one of 'generator-weight-ulp'")
    assert not out.exists()


def _assert_reward_plot_draws_rolling_means(run: Path, default_run: Path, control_run: Path) -> None:
    """The reward figure of the report draws, per run, the per-step reward and its rolling mean
    over 10 steps (legend entries and the drawn data)."""
    import matplotlib.pyplot as plt

    from titan_audit.rl.report import onpolicy_summary, reward_figure, rolling_mean

    bi, default, control = onpolicy_summary(run), onpolicy_summary(default_run), onpolicy_summary(control_run)
    fig = reward_figure(bi, default, control)
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "batch-invariant",
        "batch-invariant, rolling mean (10 steps)",
        "native ops (default)",
        "native ops (default), rolling mean (10 steps)",
        "constructed control",
        "constructed control, rolling mean (10 steps)",
    ]
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    for summary, label in (
        (bi, "batch-invariant"),
        (default, "native ops (default)"),
        (control, "constructed control"),
    ):
        rewards = [r["reward_mean"] for r in summary["per_step"]]
        assert drawn[label] == rewards
        assert drawn[f"{label}, rolling mean (10 steps)"] == rolling_mean(rewards, 10)
    plt.close(fig)


def test_rolling_mean_is_the_trailing_window_mean():
    from titan_audit.rl.report import rolling_mean

    values = [float(v) for v in range(1, 13)]  # 1 .. 12
    means = rolling_mean(values, 10)
    assert means[:3] == [1.0, 1.5, 2.0]  # a partial window at the start
    assert means[9] == sum(values[:10]) / 10 and means[11] == sum(values[2:12]) / 10
    assert rolling_mean(values, 1) == values and rolling_mean([], 10) == []
    with pytest.raises(ValueError, match="window"):
        rolling_mean(values, 0)


def test_verify_onpolicy_exits_1_without_batch_invariant_mode(tmp_path):
    out = tmp_path / "n"
    proc = cli(
        "verify-onpolicy",
        "--config",
        "rl-tiny",
        "--steps",
        "2",
        "--out",
        str(out),
        *TINY,
        "--set",
        "determinism.batch_invariant=false",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "GAP:" in proc.stdout and (out / "reports" / "onpolicy.html").is_file()


def test_rl_runs_without_verification_figures(tmp_path):
    out = tmp_path / "r"
    proc = cli("rl", "--config", "rl-tiny", "--steps", "1", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pyarrow.parquet as pq

    row = pq.read_table(out / "metrics.parquet").to_pylist()[0]
    assert "gap_tokens" not in row and row["ratio_min"] == 1.0 and 0.0 <= row["reward_mean"] <= 1.0


def _render_in_chromium(page: Path, tmp_path: Path) -> None:
    """Headless chromium renders the page (screenshot non-empty); skipped where none is installed."""
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        return  # no browser on this machine: the structural checks above stand alone
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1200,1600",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert shot.is_file() and shot.stat().st_size > 10_000


@pytest.mark.slow
def test_a_tensor_parallel_trainer_and_a_tp1_generator_have_a_zero_gap(tmp_path):
    """The trainer at TP=2 (parallel.tp = 2 on 2 ranks), the built-in generator at TP=1 with the
    gathered full weights: verify-onpolicy's gap is zero at every step. Negative control (--control):
    the generator sent the gathered weights one ulp off, at the same layout, shows a gap."""
    out = tmp_path / "tp2"
    verdict = _verify_onpolicy(out, "--nproc", "2", "--set", "parallel.tp=2")
    assert verdict["zero_gap"] is True and verdict["tokens_compared"] > 0 and verdict["tokens_differing"] == 0
    assert verdict["control"]["shows_gap"] is True and verdict["control"]["tokens_differing"] > 0
    history = json.loads((out / "manifest.json").read_text())["world_size_history"]
    assert history[0]["mesh"] == {"device_type": "cpu", "dp": 1, "tp": 2}
