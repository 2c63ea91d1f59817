"""TRL's reward functions run unchanged as `task.rewards` (rl/user_task.py): they receive
`completion_ids` (the tokens before the first EOS, as lists of ints) and `trainer_state` (a frozen
RewardState) when their signature takes them, may return None for "not applicable" (TRL's nansum
over the functions), and GRPO on them is bitwise the same at W=1 and W=2 with zero gap.

Negative controls: another reward weight changes the audited rewards; a function that reads
`completion_ids` scores the ids the project constructs (EOS cut, later tokens ignored), so a wrong
cut would show; a sample on which every function returns None is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from command_line import cli

from titan_audit.audit import compare_runs
from titan_audit.rl.config import load_rl_config
from titan_audit.rl.loop import rl_train
from titan_audit.rl.tasks import TOKENIZER, Prompt, RewardError
from titan_audit.rl.user_task import RewardState, accepted_arguments, build_task

pytest.importorskip("trl.rewards", reason="trl is not installed (the `peers` extra)")

EOS = TOKENIZER.eos_id
WORDS = ["lamp", "stone", "river", "cloud"]

REWARDS = '''
from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

repetition = get_repetition_penalty_reward(ngram_size=1, max_penalty=-1.0)
overlong = get_soft_overlong_punishment(max_completion_len=5, soft_punish_cache=3)


def only_long(prompts, completions, completion_ids, **kwargs):
    """None ("not applicable") for completions of fewer than 3 tokens."""
    return [None if len(ids) < 3 else 0.1 * len(ids) for ids in completion_ids]


def scheduled(prompts, completions, trainer_state, answer):
    """A reward that changes with training progress (no **kwargs: gets trainer_state by name)."""
    return [trainer_state.global_step / trainer_state.max_steps + (c.strip() == a) for c, a in zip(completions, answer)]


def plain(prompts, completions, answer):
    """Written without completion_ids, trainer_state or **kwargs: must keep working."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def ids_seen(completion_ids, **kwargs):
    out = [float(sum(ids)) for ids in completion_ids]
    completion_ids[0].append(999)  # editing its arguments must change nothing else
    return out


def never(prompts, completions, **kwargs):
    return [None] * len(completions)
'''


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trl-inputs")
    rows = [{"prompt": f"Reverse: {w} ->", "answer": w[::-1]} for w in WORDS]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "trl_rewards.py").write_text(REWARDS)
    return root


def settings(root: Path, names: list[str], weights: list[float], steps: int = 2) -> list[str]:
    specs = ", ".join(f'"{root / "trl_rewards.py"}:{n}"' for n in names)
    return [
        f'task.prompts="{root / "prompts.jsonl"}"',
        f"task.rewards=[{specs}]",
        f"task.reward_weights={json.dumps(weights)}",
        "task.prompts_per_step=2",
        "task.samples_per_prompt=4",
        "sampling.max_new_tokens=6",
        "optimizer.lr=1e-3",
        "verify=true",
        f"steps={steps}",
    ]


TRL_RUN = (["repetition", "overlong", "only_long", "scheduled"], [1.0, 1.0, 0.5, 1.0])


def test_the_signature_decides_what_a_function_receives(inputs):
    task = build_task(load_rl_config("rl-tiny", settings(inputs, ["repetition", "plain", "scheduled"], [1, 1, 1])))
    assert [sorted(r.takes) for r in task.rewards] == [
        ["completion_ids", "trainer_state"],  # TRL's callable classes take **kwargs
        [],
        ["trainer_state"],
    ]

    class Opaque:  # a callable whose signature cannot be read gets everything, as TRL passes it
        __signature__ = "unreadable"

        def __call__(self, *args, **kwargs):
            return []

    assert accepted_arguments(Opaque()) == {"completion_ids", "trainer_state"}
    assert accepted_arguments(lambda prompts, completions, completion_ids: []) == {"completion_ids"}
    state = RewardState(global_step=4, step=5, max_steps=10)
    with pytest.raises(AttributeError):
        state.global_step = 0  # read-only


def test_trl_rewards_score_the_ids_before_eos_and_none_is_nansum(inputs):
    names = ["repetition", "overlong", "only_long", "ids_seen", "plain", "scheduled"]
    task = build_task(load_rl_config("rl-tiny", settings(inputs, names, [1.0] * 6, steps=10)))
    row = 1  # "stone"
    prompt = Prompt(0, 3, "prompts", task.texts[row], "", task.ids[row], row)
    enots = list(b"enots")
    samples = [
        (0, [*enots, EOS]),  # exact answer, five tokens: overlong -(5-2)/3 = -1.0
        (1, [97, 97, EOS, 98, 98, 98]),  # "aa": tokens after the EOS are not the completion's
        (2, [97, 98, 97, 98]),  # no EOS (length-capped): all four tokens
    ]
    got = task.score_group(prompt, samples)
    repetition = [0.0, -(1 - 1 / 2), -(1 - 2 / 4)]  # "enots": five distinct tokens
    overlong = [-1.0, 0.0, -2 / 3]
    only_long = [0.5, None, 0.4]
    ids_seen = [float(sum(enots)), 194.0, 390.0]
    plain = [1.0, 0.0, 0.0]
    scheduled = [2 / 10 + 1, 2 / 10, 2 / 10]  # step 3: two optimizer steps done, as TRL's global_step
    expected = []
    for k in range(3):
        parts = [repetition[k], overlong[k], only_long[k], ids_seen[k], plain[k], scheduled[k]]
        total = 0.0
        for v in parts:
            total = total if v is None else total + 1.0 * v
        expected.append(total)
    assert [float(x).hex() for x in got] == [x.hex() for x in expected]
    # the control: with the EOS not cut, ids_seen and the lengths would differ
    assert sum([97, 97, EOS, 98, 98, 98]) != ids_seen[1]


def test_a_sample_every_function_leaves_none_is_refused(inputs):
    task = build_task(load_rl_config("rl-tiny", settings(inputs, ["only_long", "never"], [1.0, 1.0])))
    prompt = Prompt(1, 2, "prompts", task.texts[0], "", task.ids[0], 0)
    assert task.score_group(prompt, [(0, [97, 98, 99])]) == [pytest.approx(0.3)]  # one number is enough
    with pytest.raises(RewardError, match=r"every reward function .* returned None for step 2, prompt 1 .*sample 5"):
        task.score_group(prompt, [(4, [97, 98, 99]), (5, [97, EOS])])


def test_trl_rewards_world_sizes_one_and_two_bitwise_with_zero_gap(inputs, tmp_path):
    args = [a for s in settings(inputs, *TRL_RUN) for a in ("--set", s)]
    runs = {w: tmp_path / f"w{w}" for w in (1, 2)}
    rl_train(load_rl_config("rl-tiny", settings(inputs, *TRL_RUN)), runs[1], quiet=True)
    proc = cli("rl", "--config", "rl-tiny", "--out", str(runs[2]), "--nproc", "2", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = compare_runs(runs[1], runs[2])
    assert result.identical and result.compared > 0, result.first_divergence
    rows = [pq.read_table(out / "metrics.parquet").to_pylist() for out in runs.values()]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    for row in rows[0] + rows[1]:
        assert row["gap_tokens"] > 0 and row["gap_tokens_differing"] == 0 and row["gap_max_abs"] == 0.0
    audit = pq.read_table(runs[2] / "audit").to_pylist()
    assert len({r["hash"] for r in audit if r["name"] == "rewards"}) > 1  # the rewards vary
    # the negative control: another weight on TRL's overlong punishment changes the audited rewards
    names, weights = TRL_RUN
    rl_train(
        load_rl_config("rl-tiny", settings(inputs, names, [1.0, 0.5, 0.5, 1.0], steps=1)),
        tmp_path / "other",
        quiet=True,
    )
    other = compare_runs(runs[1], tmp_path / "other")
    assert not other.identical and other.first_divergence["name"] == "rewards", other.first_divergence
