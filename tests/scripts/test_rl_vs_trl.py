"""scripts/rl_vs_trl.py's report, on made-up gains and curves (the side-by-side run itself is the
script's, not a test): the verdict arithmetic (TRL's mean and standard error, the 2-SE margins),
each verdict with a negative control on the other side of its margin, the Markdown table and the
HTML page, loaded in headless Chromium."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rl_vs_trl.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("rl_vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_vs_trl"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["rl_vs_trl"]


TRL = [0.10, 0.12, 0.14, 0.16, 0.18]  # mean 0.14, sample std sqrt(0.001), SE sqrt(0.001 / 5) = 0.0141421...
SE = math.sqrt(0.001 / 5)


def test_verdicts_arithmetic(script):
    v = script.verdicts({"ours-bi": [0.12] * 5, "ours-native": [0.14] * 5, "trl": TRL})
    assert v.seeds == 5
    assert abs(v.trl_mean - 0.14) < 1e-12 and abs(v.trl_se - SE) < 1e-12 and abs(v.margin - 2 * SE) < 1e-12
    # 0.12 >= 0.14 - 0.0283; |0.14 - 0.12| = 0.02 <= 0.0283; 0.14 >= 0.10
    assert v.trl_learns and v.bi_holds and v.native_holds
    assert [line.rsplit(": ", 1)[1] for line in v.lines()[1:]] == ["yes", "yes", "yes"], v.lines()


def test_verdicts_negative_controls(script):
    # BI 0.11 < 0.14 - 0.0283 = 0.1117; native 0.15 is 0.04 > 0.0283 from BI; TRL's mean 0.09 < 0.10
    v = script.verdicts({"ours-bi": [0.11] * 5, "ours-native": [0.15] * 5, "trl": TRL})
    assert v.trl_learns and v.bi_holds is False and v.native_holds is False
    assert [line.rsplit(": ", 1)[1] for line in v.lines()[1:]] == ["yes", "NO", "NO"]
    low = script.verdicts({"trl": [t - 0.05 for t in TRL]})
    assert low.trl_learns is False and "NO" in low.lines()[1]


def test_verdicts_without_a_variant(script):
    assert script.verdicts({"ours-bi": [0.2, 0.3], "trl": [0.2]}) is None  # one TRL seed: no standard error
    v = script.verdicts({"ours-native": [0.2, 0.3], "trl": [0.2, 0.3]})
    assert v.bi_mean is None and v.bi_holds is None and v.native_holds is None
    assert v.lines()[2:] == ["ours BI: not run", "ours native within 2 SE of ours BI: not run"]


def curves():
    """Three variants x two seeds of 40 steps: reward 0.2 for 10 steps, then a ramp to 0.5 + a bit."""
    ramp = [0.2] * 10 + [0.2 + 0.3 * i / 19 for i in range(20)] + [0.5] * 10
    return {
        v: {s: [r + 0.01 * s + 0.001 * k for r in ramp] for s in (0, 1)}
        for k, v in enumerate(("ours-bi", "ours-native", "trl"))
    }


def test_report_table(script):
    table, lines = script.report(curves(), "Start: made up.")
    assert "| trl | 1 | 0.212 | 0.512 | +0.300 |" in table
    assert "trl: gain mean +0.300, min +0.300" in table
    assert "\n- TRL learns (mean gain >= +0.10): yes\n" in table and lines[1].endswith("yes")
    assert script.STATISTICAL in table and all(d in table for d in script.REMAINING)


def test_page_renders_in_headless_chromium(script, tmp_path):
    from headless_chromium import Chromium

    table, lines = script.report(curves(), "Start: made up.")
    path = tmp_path / "learning.html"
    path.write_text(script.page(curves(), table, "made up", lines))
    with Chromium() as browser:
        page = browser.load(path)
    assert page.errors == [], page.errors
    assert page.svgs == 1 and "TRL learns" in page.text and "ours-bi (2 seeds)" in page.text


def test_user_task_rows_for_trl(script):
    """The user-task recipe through the TRL side's task: the rows of our steps 1..3 in order (each
    row's prompt and answer), our reward functions with their weights; a control seed reorders them."""
    from titan_audit.bench.trl_peer import byte_tokenizer
    from titan_audit.rl.config import load_rl_config
    from titan_audit.rl.user_task import build_task

    recipe = str(SCRIPT.parents[1] / "recipes" / "rl-user-task.toml")
    config = load_rl_config(recipe, ["steps=3"])
    assert script.check_trl_task(config) is None
    rows, funcs, weights = script.trl_task(config, byte_tokenizer())
    task = build_task(config)
    ours = [task.raw[p.row] for step in (1, 2, 3) for p in task.prompts(step)]
    assert [r["prompt"] for r in rows] == ours and len(rows) == 3 * config.task.prompts_per_step
    assert all(r["answer"] == r["prompt"].removeprefix("Reverse: ").removesuffix(" -> ")[::-1] for r in rows)
    assert [f.__name__ for f in funcs] == ["exact", "letters"] and weights == [0.5, 0.5]
    exact, letters = funcs
    assert exact(["p"] * 2, [" tac", "tab"], answer=["tac"] * 2) == [1.0, 0.0]
    assert letters(["p"] * 3, ["tac", "tab", ""], answer=["tac"] * 3, trainer_state=None) == [1.0, 2 / 3, 0.0]
    other, _, _ = script.trl_task(load_rl_config(recipe, ["steps=3", "seed=1"]), byte_tokenizer())
    assert [r["prompt"] for r in other] != ours
    assert script.check_trl_task(load_rl_config(recipe, ["task.prompt_column='text'"])).startswith("task.prompt_column")
