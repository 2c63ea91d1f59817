"""TRL's GRPOTrainer as a peer of `bench rl`: the same RL config's step, timed in TRL.

    reason = trl_missing()                      # None when trl imports; else the skip line's reason
    seconds = trl_step_seconds(config, threads=2)  # median s/step after the first, in a subprocess

What runs (one subprocess `python -m titan_audit.bench.trl_peer SPEC.json`, so its torch thread
count and its imports of trl / transformers / accelerate never reach the caller; vLLM is hidden
from it, so trl does not import it):
- the model: the RL run's own starting weights (`rl.init.load_initial_model(config, None)`: the
  deterministic init of (config.model, seed)), written with `models.save_pretrained` and read by
  `transformers.AutoModelForCausalLM.from_pretrained` in float32 (no bf16, no gradient
  checkpointing);
- the prompts: `rl.tasks.prompt_set(task, seed, step, P)` for steps 1..steps in order (the
  prompts of our run's steps; `shuffle_dataset=False`), tokenized by a byte-level HF tokenizer
  whose ids are `ByteTokenizer`'s (byte b -> id b, EOS 256, PAD 257), so TRL sees our prompt ids;
  the model's vocab may be larger than the tokenizer's 258 ids (the qwen3-0.6b widths: 151936):
  TRL samples over the model's full vocab as our generator does (the HF model's vocab and LM-head
  width are checked to equal config.model's), and decoding drops ids >= 258 as ours does;
- the reward: our task's `rl.tasks.score` of `completion_text(completion_ids)`, the reward our
  loop gives the same completion;
- the shape: G = task.samples_per_prompt generations per prompt, P = task.prompts_per_step
  prompts per optimizer step as P gradient-accumulation microbatches of G completions (ours: one
  prompt group per microbatch), one generation batch of P x G per step (`generate` of HF
  transformers on CPU, `use_vllm=False`, KV cache on), max_completion_length =
  sampling.max_new_tokens, our temperature / top_p / top_k; loss: epsilon = loss.clip_eps,
  beta = loss.kl_coef, one iteration per generation (TRL skips the old log-prob forward then),
  TRL's default loss_type and reward scaling; optimizer: TRL's default AdamW (torch's fused
  AdamW) at our lr, betas, eps, weight decay and grad clip, constant schedule, no warm-up;
- no eval, no checkpoint, no logging (`logging_strategy="no"`, `report_to="none"`, no tqdm).
- the memory policy is ours, so TRL's torch allocates as ours does: the subprocess runs
  `-m titan_audit.bench.trl_peer`, so importing titan_audit sets it up before torch loads
  (`titan_audit/memory_policy.py`: huge pages and glibc's malloc keeping freed memory, unless the
  user set their own; TRL's step is faster with them too, so leaving them out would flatter us).
A step's time is the interval between consecutive `on_step_end` callbacks (everything TRL does
per optimizer step: fetching the prompts, generation, rewards, forwards, backwards, clipping, the
optimizer step); the figure is the median over the steps after the first.
The numbers are TRL's (nondeterministic sampling, its own kernels); nothing here is compared bitwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TRL_EXTRA = "peers"  # pyproject's optional extra that installs the pinned trl
RESULT_PREFIX = "TRL_PEER_RESULT "


def trl_missing() -> str | None:
    """None when trl can be imported here; otherwise the reason (a skip line, never a figure)."""
    if importlib.util.find_spec("trl") is None:
        return f"trl is not installed (pip install 'titan-audit[{TRL_EXTRA}]')"
    return None


def trl_step_seconds(config, *, threads: int, timeout: float = 1800.0) -> dict[str, Any]:
    """TRL's median seconds per step (after the first) on `config` (an RLConfig) with `threads`
    intra-op threads, in a subprocess; also `steps` (the per-step seconds), `trl_version` and
    `vocab_size` (the HF model's).
    RuntimeError naming the command and its stderr tail when the subprocess fails."""
    from titan_audit.rl.config import to_dict

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with tempfile.TemporaryDirectory(prefix="titan-audit-trl-peer-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": to_dict(config), "threads": threads, "workdir": tmp}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.update({"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"})
        env.update({"TRANSFORMERS_VERBOSITY": "error", "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""})
        command = [sys.executable, "-m", "titan_audit.bench.trl_peer", str(spec)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or len(lines) != 1:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
        raise RuntimeError(f"TRL peer failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    return json.loads(lines[0].removeprefix(RESULT_PREFIX))


def byte_tokenizer():
    """An HF fast tokenizer with `data.tokenizer.ByteTokenizer`'s ids: UTF-8 byte b -> id b, no
    merges, '<eos>' = 256, '<pad>' = 257; decoding skips ids it does not know (>= 258)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from titan_audit.data.tokenizer import ByteTokenizer

    byte_char = bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    vocab |= {"<eos>": ByteTokenizer.eos_id, "<pad>": ByteTokenizer.pad_id}
    tokenizer = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def matched_rows(config, steps: int, tokenizer) -> list[dict[str, Any]]:
    """The dataset rows TRL walks in order (shuffle_dataset=False): our prompt sets of steps
    1..steps, each prompt with what our reward needs; checked to tokenize to our prompts' ids."""
    from titan_audit.rl.tasks import prompt_set

    P = config.task.prompts_per_step
    rows = [
        {"prompt": p.text, "answer": p.answer, "task": p.task, "prompt_id": p.id, "step": p.step}
        for step in range(1, steps + 1)
        for p in prompt_set(config.task.name, config.seed, step, P)
    ]
    check = [tuple(tokenizer(text=r["prompt"])["input_ids"]) for r in rows[:P]]
    assert check == [p.ids for p in prompt_set(config.task.name, config.seed, 1, P)], "byte tokenizer ids differ"
    return rows


def task_reward(prompts, completions, completion_ids, answer, task, prompt_id, step, **_) -> list[float]:
    """Our task's reward (`rl.tasks.score`) of each TRL completion, called as TRL calls a reward."""
    from titan_audit.rl.tasks import Prompt, completion_text, score

    return [
        score(Prompt(i, s, t, text, a), completion_text(list(ids)), j)
        for j, (text, ids, a, t, i, s) in enumerate(zip(prompts, completion_ids, answer, task, prompt_id, step))
    ]


def grpo_args(trl, config, output_dir: str, max_steps: int, **overrides: Any):
    """trl.GRPOConfig with our run's hyperparameters: P prompts x G samples a step as one
    optimizer step, our sampling, clip, KL coefficient and AdamW, constant lr, CPU, fp32."""
    opt = config.optimizer
    P, G = config.task.prompts_per_step, config.task.samples_per_prompt
    kwargs = dict(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=G,
        gradient_accumulation_steps=P,
        num_generations=G,
        max_completion_length=config.sampling.max_new_tokens,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        top_k=config.sampling.top_k,
        shuffle_dataset=False,
        use_vllm=False,
        epsilon=config.loss.clip_eps,
        beta=config.loss.kl_coef,
        num_iterations=1,
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=config.seed,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    kwargs.update(overrides)
    return trl.GRPOConfig(**kwargs)


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    import time

    import torch

    torch.set_num_threads(spec["threads"])
    sys.modules["vllm"] = None  # use_vllm=False: trl then never imports vLLM (seconds of imports, version warnings)
    import datasets
    import transformers
    import trl

    from titan_audit import models
    from titan_audit.rl.config import from_dict
    from titan_audit.rl.init import load_initial_model

    config = from_dict(spec["config"])
    if config.task.prompts is not None or config.tokenizer.path is not None:
        raise ValueError("the TRL peer runs the built-in tasks with the byte tokenizer only")
    work = Path(spec["workdir"])
    model_dir = models.save_pretrained(load_initial_model(config, None), work / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = config.model.model_config().vocab_size
    logits_width = model.get_output_embeddings().weight.shape[0]
    assert model.config.vocab_size == logits_width == vocab, f"HF vocab {logits_width}, ours {vocab}"
    tokenizer = byte_tokenizer()
    assert len(tokenizer) <= vocab, f"byte tokenizer ids ({len(tokenizer)}) beyond the model's vocab {vocab}"
    rows = matched_rows(config, config.steps, tokenizer)
    args = grpo_args(trl, config, str(work / "trl"), config.steps)

    ends: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not ends:
                ends.append(time.perf_counter())  # the first step's start

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    steps = [b - a for a, b in zip(ends, ends[1:])]
    assert len(steps) == config.steps, f"timed {len(steps)} TRL steps of {config.steps}"
    timed = steps[1:] or steps
    return {
        "seconds": statistics.median(timed),
        "steps": steps,
        "trl_version": trl.__version__,
        "threads": torch.get_num_threads(),
        "vocab_size": model.config.vocab_size,
        "optimizer": str(args.optim),
        "loss_type": str(args.loss_type),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    print(RESULT_PREFIX + json.dumps(_run(spec)), flush=True)


if __name__ == "__main__":
    main()
