"""Your own RL task (rl/user_task.py): a JSONL of prompts, reward functions in a user module and an
HF tokenizer trained here. GRPO on it is bitwise the same at W=1 and W=2, has zero gap, and a
kill -9 + resume is the uninterrupted run. Negative controls: another reward changes the hashes, a
nondeterministic reward is caught, a raising reward names the sample, a tokenizer that does not
fit the model and a resume with an edited prompts file or reward module are refused, and a bad
`task.reward` is one line + exit 2 on the command line.

One module fixture makes the shared runs (W=1, W=2, killed + resumed) from the deterministic init
of tiny-dense (a random policy: its completions and rewards vary, so the updates are not zero).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from command_line import cli
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_audit.audit import compare_runs
from titan_audit.rl.config import load_rl_config
from titan_audit.rl.job import check_inputs
from titan_audit.rl.loop import RL_JOB, rl_train
from titan_audit.rl.tasks import NondeterministicRewardError, RewardError
from titan_audit.rl.user_task import build_task, prompt_rows
from titan_audit.trainer.launch import LaunchOptions

WORDS = ["lamp", "stone", "river", "cloud", "apple", "tiger", "music", "paper"]

REWARDS = '''
def overlap(prompts, completions, answer, **columns):
    """Shared letters with the answer, over the union (a shaped reward in [0, 1))."""
    return [len(set(c) & set(a)) / (1 + len(set(c) | set(a))) for c, a in zip(completions, answer)]


def brevity(prompts, completions, **columns):
    return [-0.01 * len(c) for c in completions]
'''


def make_tokenizer(path: Path, vocab_size: int = 300, special=("<|endoftext|>",)) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([f"Reverse: {w} -> {w[::-1]}" for w in WORDS * 4], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    make_tokenizer(root / "tokenizer.json")
    rows = [{"prompt": f"Reverse: {w} ->", "answer": w[::-1], "level": i % 3} for i, w in enumerate(WORDS)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def settings(root: Path, *extra: str, steps: int = 3) -> list[str]:
    return [
        f'task.prompts="{root / "prompts.jsonl"}"',
        f'task.rewards=["{root / "rewards.py"}:overlap", "{root / "rewards.py"}:brevity"]',
        "task.reward_weights=[1.0, 0.5]",
        f'tokenizer.path="{root / "tokenizer.json"}"',
        "task.prompts_per_step=2",
        "task.samples_per_prompt=4",
        "sampling.max_new_tokens=6",
        "optimizer.lr=1e-3",
        "checkpoint.interval=1",
        "verify=true",
        f"steps={steps}",
        *extra,
    ]


def config(root: Path, *extra: str, steps: int = 3):
    return load_rl_config("rl-tiny", settings(root, *extra, steps=steps))


def rl_args(root: Path, out: Path) -> list[str]:
    return ["rl", "--config", "rl-tiny", "--out", str(out), *[a for s in settings(root) for a in ("--set", s)]]


def metrics(run: Path) -> list[dict]:
    return pq.read_table(run / "metrics.parquet").to_pylist()


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory) -> dict[str, Path]:
    """The shared runs: W=1, W=2, and W=1 killed with SIGKILL after step 2 then resumed."""
    root = tmp_path_factory.mktemp("runs")
    out = {"w1": root / "w1", "w2": root / "w2", "killed": root / "killed"}
    one = cli(*rl_args(inputs, out["w1"]))
    assert one.returncode == 0, one.stderr[-3000:]
    two = cli(*rl_args(inputs, out["w2"]), "--nproc", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    killed = cli(*rl_args(inputs, out["killed"]), env={"TITAN_AUDIT_CRASH_AT": "rl.after_step:2"})
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    resumed = cli("rl", "--out", str(out["killed"]), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out


def test_world_sizes_one_and_two_are_bitwise_identical_with_zero_gap(runs, inputs):
    result = compare_runs(runs["w1"], runs["w2"])
    assert result.identical and result.compared > 0, result.first_divergence
    a, b = metrics(runs["w1"]), metrics(runs["w2"])
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["world_size"] for r in b] == [2, 2, 2]
    for row in a + b:
        assert row["gap_tokens"] > 0 and row["gap_tokens_differing"] == 0 and row["gap_max_abs"] == 0.0
        assert row["ratio_min"] == row["ratio_max"] == 1.0
    assert any(r["grad_norm"] > 0 for r in a), "the test needs a non-zero update"
    audit = pq.read_table(runs["w2"] / "audit").to_pylist()
    assert {r["rank"] for r in audit if r["phase"] == "rollout"} == {0, 1}
    assert len({r["hash"] for r in audit if r["name"] == "rewards"}) > 1  # the rewards vary
    manifest = json.loads((runs["w1"] / "manifest.json").read_text())
    task_inputs = manifest["task_inputs"]
    assert task_inputs["prompts"]["path"] == str(inputs / "prompts.jsonl") and task_inputs["prompts"]["rows"] == 8
    assert [r["spec"].rsplit(":", 1)[1] for r in task_inputs["rewards"]] == ["overlap", "brevity"]
    assert task_inputs["tokenizer"].startswith("hf:")


def test_kill_minus_nine_and_resume_is_the_uninterrupted_run(runs):
    result = compare_runs(runs["w1"], runs["killed"])
    assert result.identical and result.compared > 0, result.first_divergence
    assert [r["loss"] for r in metrics(runs["w1"])] == [r["loss"] for r in metrics(runs["killed"])]
    history = json.loads((runs["killed"] / "manifest.json").read_text())["world_size_history"]
    assert [h["start_step"] for h in history] == [0, 1]  # killed before checkpoint 2: step 2 runs again


def test_negative_control_another_reward_changes_the_hashes(runs, inputs, tmp_path):
    rl_train(config(inputs, "task.reward_weights=[1.0, 0.25]", steps=1), tmp_path / "other", quiet=True)
    result = compare_runs(runs["w1"], tmp_path / "other")
    assert not result.identical
    assert result.first_divergence is not None and result.first_divergence["name"] == "rewards", result.first_divergence


def test_a_nondeterministic_reward_is_detected(inputs, tmp_path):
    (tmp_path / "counter.py").write_text(
        "CALLS = 0\n\ndef counted(prompts, completions, **columns):\n"
        "    global CALLS\n    CALLS += 1\n    return [float(CALLS)] * len(completions)\n"
    )
    spec = f'task.rewards=["{tmp_path / "counter.py"}:counted"]'
    with pytest.raises(
        NondeterministicRewardError, match=r"counter\.py:counted' is nondeterministic: step 1, prompt 0 "
    ):
        rl_train(config(inputs, spec, "task.reward_weights=[1.0]", steps=1), tmp_path / "n", quiet=True)
    # the control: with the check off the same reward runs (the check is what caught it)
    rl_train(
        config(inputs, spec, "task.reward_weights=[1.0]", "task.reward_check=false", steps=1),
        tmp_path / "m",
        quiet=True,
    )


def test_a_raising_or_bad_reward_names_function_and_sample(inputs, tmp_path):
    (tmp_path / "bad.py").write_text(
        "def raises(prompts, completions, **columns):\n"
        "    if any(len(c) > 0 for c in completions):\n        raise ZeroDivisionError('too long')\n"
        "    return [0.0] * len(completions)\n\n"
        "def short(prompts, completions, **columns):\n    return [0.0]\n\n"
        "def nan(prompts, completions, **columns):\n    return [float('nan')] * len(completions)\n"
    )
    for name, pattern in [
        (
            "raises",
            r"'[^']*bad\.py:raises' raised for step 1, prompt 0 \(row \d of prompts\.jsonl\), sample \d .*ZeroDiv",
        ),
        ("short", r"'[^']*bad\.py:short' returned 1 values .* expected a list of 4 floats"),
        ("nan", r"'[^']*bad\.py:nan' returned nan \(not a finite number\) for step 1, prompt 0 .*sample 0"),
    ]:
        spec = f'task.rewards=["{tmp_path / "bad.py"}:{name}"]'
        with pytest.raises(RewardError, match=pattern):
            rl_train(config(inputs, spec, "task.reward_weights=[1.0]", steps=1), tmp_path / name, quiet=True)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"vocabulary of 300 tokens is larger than model.vocab_size 256; set model"):
        check_inputs(config(inputs, "model.overrides.vocab_size=256"), 1)
    no_eos = make_tokenizer(tmp_path / "no-eos.json", special=("<pad>",))
    with pytest.raises(ValueError, match=r"tokenizer.path: .*no end-of-text token.*set tokenizer.eos_token"):
        check_inputs(config(inputs, f'tokenizer.path="{no_eos}"'), 1)
    assert check_inputs(config(inputs, f'tokenizer.path="{no_eos}"', 'tokenizer.eos_token="<pad>"'), 1)


def test_a_resume_with_edited_prompts_or_reward_module_is_refused(runs, inputs):
    more = config(inputs, steps=4)
    RL_JOB.check_run(more, runs["w1"], 1, LaunchOptions(resume=True))  # unchanged: allowed
    for name, needle in [("prompts.jsonl", "the prompts file"), ("rewards.py", "the reward module")]:
        path = inputs / name
        original = path.read_bytes()
        try:
            path.write_bytes(original.replace(b"lamp", b"lump").replace(b"0.01", b"0.02"))
            with pytest.raises(ValueError, match=rf"{needle} .*{name}.* changed .* since the run started"):
                RL_JOB.check_run(more, runs["w1"], 1, LaunchOptions(resume=True))
        finally:
            path.write_bytes(original)


def test_the_prompt_order_is_a_keyed_function_of_seed_and_step():
    epoch = [r for step in range(1, 5) for r in prompt_rows(0, step, 2, 8, shuffle=True)]
    assert sorted(epoch) == list(range(8)) and epoch != list(range(8))  # each row once per epoch
    assert prompt_rows(0, 3, 2, 8, True) == epoch[4:6]  # any step alone
    assert prompt_rows(1, 1, 8, 8, True) != epoch  # another seed, another order
    assert prompt_rows(0, 5, 3, 8, shuffle=False) == [4, 5, 6]  # file order, wrapping: (5-1)*3 = 12 -> 4


def test_a_parquet_prompts_file_gives_the_jsonl_prompts(inputs, tmp_path):
    rows = [json.loads(line) for line in (inputs / "prompts.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    a = build_task(config(inputs))
    b = build_task(config(inputs, f'task.prompts="{tmp_path / "prompts.parquet"}"'))
    assert a.prompts(3) == b.prompts(3) and a.extra == b.extra and a.columns == ["answer", "level"]


def test_chat_template_of_a_tokenizer_directory(inputs, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    make_tokenizer(directory / "tokenizer.json", special=("<|endoftext|>", "<|user|>", "<|assistant|>"))
    template = (
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    settings_json = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings_json, "chat_template": template}))
    task = build_task(config(inputs, f'tokenizer.path="{directory}"', "tokenizer.chat_template=true"))
    (prompt,) = [p for p in task.prompts(1) if p.id == 0]
    assert prompt.text == f"<|user|>{task.raw[prompt.row]}<|assistant|>"
    assert prompt.ids == task.run_tokenizer.encode(prompt.text) and prompt.ids[
        0
    ] == task.tokenizer._tok.convert_tokens_to_ids("<|user|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings_json))
    with pytest.raises(ValueError, match=r"tokenizer.chat_template = true needs .* chat template"):
        build_task(config(inputs, f'tokenizer.path="{directory}"', "tokenizer.chat_template=true"))


def test_a_bad_reward_spec_on_the_command_line_is_one_line_and_exit_two(inputs, tmp_path):
    from click.testing import CliRunner

    from titan_audit.cli.main import cli as group

    out = tmp_path / "bad"
    args = [a for s in settings(inputs) for a in ("--set", s)] + ["--set", 'task.rewards=["nomodule:fn"]']
    args += ["--set", "task.reward_weights=[1.0]"]
    result = CliRunner().invoke(group, ["rl", "--config", "rl-tiny", "--out", str(out), *args])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert "task.reward 'nomodule:fn': cannot import module 'nomodule'" in lines[0]
    assert not out.exists()
