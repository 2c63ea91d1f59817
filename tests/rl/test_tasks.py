"""rl/tasks.py: prompt sets are pure functions of (seed, step); rewards are in [0, 1] and checked."""

from __future__ import annotations

import math

import pytest

from titan_audit.data.synthetic import solve
from titan_audit.rl import tasks
from titan_audit.rl.tasks import RewardError, Task, completion_text, prompt_set, register_task, score


@pytest.mark.parametrize("task", ["arithmetic", "reversal", "reversal-short", "sorting", "copy", "mixed"])
def test_prompt_set_is_a_pure_function_of_seed_and_step(task):
    a = prompt_set(task, 3, 7, 8)
    assert a == prompt_set(task, 3, 7, 8)
    assert a[:3] == prompt_set(task, 3, 7, 3)  # prompt i does not depend on the count
    assert a != prompt_set(task, 3, 8, 8) and a != prompt_set(task, 4, 7, 8)  # negative controls
    assert [p.id for p in a] == list(range(8)) and all(p.step == 7 for p in a)
    for p in a:
        assert p.text.endswith(" ") and p.ids == tuple(p.text.encode())
        if p.task != "copy":
            assert p.answer == solve(p.task.removesuffix("-short"), p.text.rstrip(" "))


def test_mixed_draws_every_synthetic_task():
    assert {p.task for p in prompt_set("mixed", 0, 1, 64)} == {"arithmetic", "reversal", "sorting"}


@pytest.mark.parametrize("task", ["arithmetic", "reversal", "reversal-short", "sorting", "copy"])
def test_reward_is_one_for_the_answer_and_lower_otherwise(task):
    for p in prompt_set(task, 0, 1, 16):
        assert score(p, p.answer, 0) == 1.0
        assert score(p, f"  {p.answer} ", 0) == 1.0  # surrounding whitespace does not count
        assert score(p, "", 0) == 0.0
        wrong = score(p, p.answer + "9", 0)
        assert 0.0 <= wrong < 1.0


def test_shaped_reward_gives_partial_credit():
    p = tasks.Prompt(0, 1, "reversal", "Reverse: abcd -> ", "dcba")
    assert score(p, "dcba", 0) == 1.0
    assert score(p, "abcd", 0) == pytest.approx(0.5)  # right letters, wrong order: bag F1 = 1, positional 0
    assert score(p, "dcbx", 0) == pytest.approx(0.5 * (0.75 + 0.75))
    assert score(p, "zzzz", 0) == 0.0


def test_completion_text_stops_at_eos_and_drops_non_byte_ids():
    assert completion_text([ord("a"), ord("b"), 256, ord("c")]) == "ab"
    assert completion_text([ord("a"), 1000, ord("b")]) == "ab"


def test_unknown_task_is_a_value_error():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        prompt_set("nope", 0, 1, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1, 1.5, "1", True, None])
def test_a_bad_reward_value_names_task_and_sample(bad):
    register_task(Task("t-bad", lambda rng: "Copy: ab ->", lambda p: "ab", lambda p, a, c: bad))
    p = tasks.make_prompt("t-bad", 0, 5, 3)
    with pytest.raises(RewardError, match=r"task 't-bad', step 5, prompt 3, sample 2 \(completion 'x'\)"):
        score(p, "x", 2)


def test_a_raising_reward_names_task_and_sample():
    def reward(p, a, c):
        raise KeyError("boom")

    register_task(Task("t-raise", lambda rng: "Copy: ab ->", lambda p: "ab", reward))
    with pytest.raises(RewardError, match=r"raised for task 't-raise', step 1, prompt 0, sample 7.*KeyError"):
        score(tasks.make_prompt("t-raise", 0, 1, 0), "x", 7)
    assert isinstance(RewardError("x"), ValueError)  # the CLI reports it as bad input (exit 2)
    assert math.isfinite(score(tasks.make_prompt("copy", 0, 1, 0), "x", 0))


def test_short_reversal_words_have_three_or_four_letters():
    words = [p.text.split()[1] for p in prompt_set("reversal-short", 0, 1, 64)]
    assert {len(w) for w in words} == {3, 4}
