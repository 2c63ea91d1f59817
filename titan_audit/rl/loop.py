"""The RL loop: GRPO-style post-training on the run engine, with a deterministic rollout lag.

    result = rl_train(config, "runs/rl", init="runs/warmup")     # this process's rank of the group
    result = rl_train(config, "runs/rl", resume=True)            # continue from the latest checkpoint

The run engine (trainer/run.py, trainer/step.py) does what every run does: process group, numerics (BI mode on
for the whole run, both threads, when `determinism.batch_invariant` is set), rank-0 checks, the
run lock, manifest, recorder, the fixed-tree reduction, clipping, AdamW, checkpoints, close on any
exception. What is RL's own, a step k on rank r of W (P prompts = V microbatches, G samples each):
  1. the rollouts of step k (rl/rollout_schedule.py: generated in a background thread by the
     built-in generator, or with `generator = "vllm"` by our model inside vLLM, from policy
     version max(0, k-1-lag), after a weight sync checked by fingerprints): rank r serves its block
     [r*P/W, (r+1)*P/W) of the step's prompt set, under FSDP2 the prompts k*W + r (rl/init.py);
     sample j of prompt i is keyed (seed, k, i, j);
  2. rewards (the task's: built-in, or the user's prompts file and reward functions, rl/user_task.py;
     checked: a raising or non-finite reward stops the run naming task and sample) and
     group-normalised advantages, per prompt;
  3. per prompt group (= virtual microbatch, global index = prompt id): the trainer's log-probs
     of the sampled tokens (one forward of prompt + completion), the clipped policy-gradient loss
     with ratio exp(trainer_lp - generator_lp) over the step's GLOBAL completion-token count,
     + kl_coef * k3 KL to the frozen initial policy; backward into the group's gradient buffer;
  4. audit records: rollout (generator weights digest, tokens, generator log-probs, rewards,
     advantages), trainer log-probs, loss; a metrics row (rl/step_metrics.py) with, under
     `verify`, the zero-gap figures (tokens compared, with any bit difference, max and mean
     |diff|, k3 KL); and timing columns, never compared (goldens keep only the named metrics):
     `seconds` (the step) and `seconds_generate` (the wait in `schedule.take`), `seconds_reward`,
     `seconds_logprobs` (trainer forwards), `seconds_backward`, `seconds_optimizer` (`kit.finish`);
  5. submit the rollouts of step k + 1 + lag (policy version k); a checkpoint's blob holds the
     finished rollouts of steps k+1 .. k+lag.

Layout (rl/init.py): data parallel (the policy whole, or over `parallel.tp` ranks), or FSDP2
(`parallel.mode = "fsdp"`: the trainer's sharding and gradient tree, the KL reference sharded too).
Which copies of the weights a setting keeps (the generator's, snapshots): rl/weights.py.

Device (`parallel.device = "cuda"`): the policy (and the KL reference) is built and loaded on the
CPU, its digest recorded, then moved to the rank's GPU; the built-in generator copies it there
(rl/builtin.py follows its weights' device), the rollout thread runs on that GPU, and the
trainer's log-probs, the generator's log-probs and advantages (moved from the samples) and the
loss are computed there. Rewards, rollout records and checkpointed rollouts stay CPU data.

Why the trajectory is the same at every W: prompts, sampling keys and rollouts depend on prompt
ids, never on ranks; a group's loss depends on that group alone and the global token count; the
tree over the P groups depends on P alone; step figures are gathered in prompt order. Why a resume
continues it bitwise: the checkpoint holds weights, optimizer state and the rollouts in flight.
The zero-gap figures compare each generator log-prob with the trainer's recomputation under the
SAME weights: at lag 0 the training forward itself; at lag > 0 (with `verify`) the worker's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_audit.rl.config import RLConfig
from titan_audit.rl.init import build_policy, prompt_ids
from titan_audit.rl.job import RLJob
from titan_audit.rl.logprobs import sequence_logprobs
from titan_audit.rl.loss import combine_gap, gap_figures, group_advantages, policy_loss
from titan_audit.rl.rollout_schedule import RolloutSchedule, build_generator
from titan_audit.rl.rollouts import RolloutResult, random_delay
from titan_audit.rl.step_metrics import group_stats, metrics_row
from titan_audit.rl.user_task import build_task
from titan_audit.rl.weights import WeightPlan, rollout_mesh
from titan_audit.trainer.init import digest_tensor
from titan_audit.trainer.launch.spec import LaunchOptions
from titan_audit.trainer.optim import build_optimizer
from titan_audit.trainer.run import Run
from titan_audit.trainer.step import StepKit


@dataclass
class RLResult:
    run_dir: Path
    world_size: int
    start_step: int
    last_step: int
    rewards: list[float]  # mean reward of each step run here
    max_gap_differing: int | None  # with verify: the most tokens with a bit difference in any step


# ---------------------------------------------------------------------------------- the loop
def rl_train(
    config: RLConfig,
    out: str | os.PathLike,
    *,
    init: str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool | str = False,
    quiet: bool = False,
    generator_factory=None,
    audit_verified: dict[str, list[int | str]] | None = None,
) -> RLResult:
    """Run (or resume) an RL run into `out` on this process's rank of the current group.
    `generator_factory(model, batch_invariant) -> Generator` replaces the configured generator.
    `audit_verified`: the audit-log parts a launcher's check verified (LaunchOptions), not read again."""
    init = None if init is None else str(init)
    options = LaunchOptions(resume=resume, overwrite=overwrite, init=init, quiet=quiet, audit_verified=audit_verified)
    run = Run(config, out, job=RL_JOB, options=options, single_group=config.parallel.mode == "fsdp")
    with run:
        task = run.checked or build_task(config)  # rank 0: the task its checks built; the others: the same inputs
        W, bi = run.mesh.world_size, config.determinism.batch_invariant
        dp, dp_group, device = run.mesh.dp, run.mesh.dp_group, run.mesh.device  # TP peers: the same prompts
        policy = build_policy(config, run, run.manifest["init"]["source"])  # digest recorded (checked on resume)
        model, reference = policy.model, policy.reference
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, config.optimizer, portable=bi)
        blob = run.restore(model, optimizer)

        ids = prompt_ids(config, dp, run.mesh.dp_rank)
        plan = WeightPlan.of(config)  # which copies of the weights this setting keeps
        slots = max(1, len(ids) * config.task.samples_per_prompt)
        factory = generator_factory or (lambda m, b: build_generator(config.generator, m, b, slots, share=plan.share))
        where = {"world_size": dp, "group": dp_group, "device": device, "mesh": rollout_mesh(plan, device.type)}
        schedule = run.closing(RolloutSchedule(config, factory(model, bi), task, prompt_ids=ids, plan=plan, **where))
        schedule.start(run.start_step, model, [RolloutResult.from_state(s) for s in (blob or {}).get("pending", [])])
        run.begin(model, optimizer)

        kit = StepKit(run, params, optimizer, policy.sharded)
        rewards, max_differing = [], None
        for step in run.steps():
            t0 = time.perf_counter()
            random_delay()
            lr = kit.start(step)
            t_take = time.perf_counter()
            result = schedule.take(step)  # generation: what the step waits for (async with a lag)
            seconds_generate = time.perf_counter() - t_take
            row = _train_step(config, run, kit, model, reference, schedule, task, result, step, lr)
            row["seconds_generate"] = seconds_generate
            rewards.append(row["reward_mean"])
            if config.verify:
                max_differing = max(max_differing or 0, row["gap_tokens_differing"])
            if step < run.last_step:  # after the last step only what its checkpoint holds
                schedule.submit_after(step, model)
            row["seconds"] = time.perf_counter() - t0
            run.end_step(step, row, _progress_line(config, row, run.last_step), lambda s=step: _pending(schedule, s))
        return RLResult(run.out, W, run.start_step, run.last_step, rewards, max_differing)


def _train_step(config, run, kit, model, reference, schedule, task, result, step: int, lr: float) -> dict:
    """Rewards, per-group loss and backward into the tree, the update; the step's metrics row."""
    W, G = run.mesh.world_size, config.task.samples_per_prompt
    gather = kit.gather_in_index_order  # over the dp ranks, in prompt order whichever prompts a rank serves
    run.recorder.record_rollout("generator_weights", digest_tensor(result.generator_fingerprint))
    run.recorder.record_rollout("policy_version", torch.tensor([result.version], dtype=torch.int64))
    timer = time.perf_counter
    t = timer()
    groups = schedule.groups(result, step)
    rewards = [
        torch.tensor(task.score_group(p, [(s.key.sample_index, s.tokens) for s in samples]), dtype=torch.float32)
        for p, samples in groups
    ]
    local_tokens = torch.tensor([[sum(len(s.tokens) for s in samples)] for _, samples in groups], dtype=torch.int64)
    denominator = max(int(gather(local_tokens).sum()), 1)  # the step's global token count
    seconds = {"reward": timer() - t, "logprobs": 0.0, "backward": 0.0}  # timing only: never compared

    stats_rows, ratio_rows, gap_rows = [], [], []
    for j, ((prompt, samples), reward) in enumerate(zip(groups, rewards)):
        with kit.microbatch(prompt.id):
            t = timer()
            lp, gen_lp, loss, parts = _group_loss(
                config, run.recorder, model, reference, prompt, samples, reward, denominator
            )
            t_backward = timer()
            loss.backward()
            seconds["logprobs"] += t_backward - t
            seconds["backward"] += timer() - t_backward
        ratio_rows.append(gap_figures(lp, gen_lp))
        if config.verify and config.rollout.lag == 0:
            gap_rows.append(ratio_rows[-1])
        elif config.verify:  # the worker's recomputation (or a checkpoint's CPU copy of it)
            same = result.extra["same_weights_logprobs"][j * G : (j + 1) * G]
            same = torch.cat(same).to(lp.device) if samples else torch.zeros(0, device=lp.device)
            run.recorder.record_logprobs(same, "same_weights_logprobs")
            gap_rows.append(gap_figures(same, gen_lp))
        stats_rows.append(group_stats(samples, reward, gen_lp, loss, parts))
    t = timer()
    grad_norm = kit.finish()  # the tree reduction, clipping and the optimizer step
    seconds["optimizer"] = timer() - t

    stats, ratios = gather(torch.stack(stats_rows)), gather(torch.stack(ratio_rows))
    row = metrics_row(step, stats, ratios, lr, grad_norm, result.version, W)
    if config.verify:
        row.update(combine_gap(gather(torch.stack(gap_rows)), "gap"))
    row.update({f"seconds_{phase}": value for phase, value in seconds.items()})
    return row


def _group_loss(config, recorder, model, reference, prompt, samples, reward, denominator: int):
    """One prompt group's records and loss: (trainer log-probs, generator log-probs, loss, parts)."""
    adv = group_advantages(reward, config.loss.adv_eps)
    completions = [s.tokens for s in samples]
    gen_lp = torch.cat([s.logprobs for s in samples])
    token_adv = torch.cat([adv[i].expand(len(c)) for i, c in enumerate(completions)])
    recorder.record_rollout("prompt_ids", torch.tensor(prompt.ids, dtype=torch.int64))
    recorder.record_rollout("completion_tokens", torch.tensor([t for c in completions for t in c], dtype=torch.int64))
    recorder.record_rollout("completion_lengths", torch.tensor([len(c) for c in completions], dtype=torch.int64))
    recorder.record_rollout("generator_logprobs", gen_lp)
    recorder.record_rollout("rewards", reward)
    recorder.record_rollout("advantages", adv)
    prompts, temperature, bi = (
        [prompt.ids] * len(samples),
        config.sampling.temperature,
        config.determinism.batch_invariant,
    )
    lp = torch.cat(sequence_logprobs(model, prompts, completions, temperature, batch_invariant=bi))
    ref_lp = None
    if reference is not None:
        with torch.no_grad():
            ref_lp = torch.cat(sequence_logprobs(reference, prompts, completions, temperature, batch_invariant=bi))
    recorder.record_logprobs(lp.detach(), "trainer_logprobs")
    gen_lp, token_adv = gen_lp.to(lp.device), token_adv.to(lp.device)  # the samples' CPU data, on the device
    loss, parts = policy_loss(lp, gen_lp, token_adv, denominator, config.loss.clip_eps, ref_lp, config.loss.kl_coef)
    recorder.record_loss(loss)
    return lp, gen_lp, loss, parts


def _pending(schedule: RolloutSchedule, step: int) -> dict:
    return {"pending": [r.to_state() for r in schedule.pending(step)]}


def _progress_line(config: RLConfig, row: dict, last_step: int) -> str:
    gap = f"  gap {row['gap_tokens_differing']}/{row['gap_tokens']}" if config.verify else ""
    return (
        f"rl step {row['step']}/{last_step}  reward {row['reward_mean']:.3f}  loss {row['loss']:+.4f}  "
        f"grad_norm {row['grad_norm']:.3f}  ratio [{row['ratio_min']:.4f}, {row['ratio_max']:.4f}]"
        f"{gap}  age {row['policy_age']}  {row['seconds']:.2f}s  W={row['world_size']}"
    )


RL_JOB = RLJob(rl_train)  # what `titan-audit rl` launches (trainer/launch)
