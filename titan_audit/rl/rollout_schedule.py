"""Which rollouts an RL rank generates, from which weights, and when (on rollouts.py's worker).

    schedule = RolloutSchedule(config, generator, task, prompt_ids=ids, world_size=W, plan=plan)
    schedule.start(start_step, model, restored)    # jobs of steps start+1 .. start+1+lag
    result = schedule.take(step)                   # blocks; this rank's samples of step `step`
    groups = schedule.groups(result, step)         # [(prompt, its G samples)] in prompt order
    schedule.submit_after(step, model)             # the job of step + 1 + lag, version `step`
    pending = schedule.pending(step)               # every rank's rollouts in flight (for a checkpoint)

`device`: the trainer's (`parallel.device`): the rollout thread runs there, and so does the
same-weights scorer (lag > 0 with verify).

Guarantees: a rank serves the prompt ids `prompt_ids` (ascending) of each step's prompt set (a
pure function of (seed, step): the task's, rl/tasks.py or rl/user_task.py): the block
[r*P/W, (r+1)*P/W) under DP, the ids k*W + r under FSDP2 (its interleaved microbatches); G samples
each keyed (seed, step, prompt id, sample index), so its rollouts do not depend on W or on which
rank serves a prompt. The rollouts of step k come from policy version max(0, k - 1 - lag)
(rollouts.py), carried as rl/weights.py's `plan` says (live tensors at lag 0, a snapshot at lag > 0).
A control run (`control`, rl/control.py) sends the generator its constructed copy of those
weights; the trainer and the same-weights scorer keep the trainer's. The scorer computes with the
generator's own model when that holds the job's weights (a built-in generator, no control run),
else with a copy of its own. What a checkpoint holds of the rollouts in flight is every rank's
part merged in (prompt id, sample index) order, so a resume at another W or layout restores each
rank's own prompts of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_audit.models import build
from titan_audit.rl.config import RLConfig
from titan_audit.rl.control import PERTURBED_TENSOR, generator_weights
from titan_audit.rl.generator import GenerationRequest, Generator, Sample, SampleKey, SamplingParams
from titan_audit.rl.logprobs import sequence_logprobs
from titan_audit.rl.rollouts import RolloutJob, RolloutResult, RolloutWorker, rollout_version, trainer_fingerprint
from titan_audit.rl.tasks import Prompt
from titan_audit.rl.weights import WeightPlan, full_weight, job_weights, live_weights


def check_prompts(config: RLConfig, prompts: list[Prompt]) -> None:
    """ValueError naming the prompt whose tokens + sampling.max_new_tokens exceed the context."""
    context = config.model.model_config().max_position_embeddings
    for p in prompts:
        need = len(p.ids) + config.sampling.max_new_tokens
        if need > context:
            raise ValueError(
                f"step {p.step} prompt {p.id} ({p.task}): {len(p.ids)} prompt tokens + "
                f"sampling.max_new_tokens {config.sampling.max_new_tokens} = {need} exceed the model's "
                f"context (max_position_embeddings {context})"
            )


def build_generator(
    kind: str, model: torch.nn.Module, batch_invariant: bool, slots: int, *, share: bool = False
) -> Generator:
    """The rollout generator `kind` ("builtin" | "vllm", config key `generator`) over a copy of
    `model`'s weights (`share`: the built-in one over `model` itself, rl/weights.py), in BI mode
    iff `batch_invariant`, running up to `slots` samples at once."""
    if kind == "vllm":
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()
        from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig

        return VllmGenerator(model, VllmGeneratorConfig(batch_invariant=batch_invariant, max_num_seqs=slots))
    assert kind == "builtin", kind
    from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig

    config = BuiltinGeneratorConfig(batch_invariant=batch_invariant, max_batch_size=slots)
    return BuiltinGenerator(model, config, share=share)


class SameWeightsScorer:
    """Worker-side (lag > 0, verify): the trainer's recomputation with the job's own weights, on
    the trainer's device. `model`: a module that holds the job's weights when the scorer runs
    (the built-in generator's, after its checked sync); None: a copy of its own, loaded from each
    job parameter by parameter."""

    def __init__(self, config: RLConfig, device: torch.device | str = "cpu", model: torch.nn.Module | None = None):
        self.config = config
        self.own = model is None
        if model is None:
            model = build(config.model.model_config(), seed=config.seed).requires_grad_(False).to(device)
        self.model = model

    def __call__(self, job: RolloutJob, samples: list[Sample]) -> dict[str, list[torch.Tensor]]:
        if self.own:
            with torch.no_grad():
                for name, target in self.model.state_dict().items():
                    target.copy_(full_weight(job.weights[name]))
        G = self.config.task.samples_per_prompt
        bi = self.config.determinism.batch_invariant
        out: list[torch.Tensor] = []
        for start in range(0, len(samples), G):
            group = samples[start : start + G]
            prompts, completions = [s.prompt_ids for s in group], [s.tokens for s in group]
            out += sequence_logprobs(
                self.model, prompts, completions, self.config.sampling.temperature, batch_invariant=bi
            )
        return {"same_weights_logprobs": out}


class RolloutSchedule:
    """The rollout side of an RL rank (see the module docstring); close() stops its thread."""

    def __init__(
        self,
        config: RLConfig,
        generator: Generator,
        task,
        *,
        prompt_ids: Sequence[int],
        world_size: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        plan: WeightPlan | None = None,
        mesh=None,
    ) -> None:
        self.config, self.generator, self.task = config, generator, task
        self.prompt_ids = sorted(prompt_ids)
        self.world_size, self.group = world_size, group  # the dp ranks (TP peers share their prompts)
        self.plan = plan or WeightPlan.of(config)
        self.mesh = mesh  # rl/weights.py rollout_mesh: where shard snapshots live
        self.lag = config.rollout.lag
        s = config.sampling
        self.params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=(task.tokenizer.eos_id,),
        )
        scorer = None
        if config.verify and self.lag > 0:
            from titan_audit.rl.builtin import BuiltinGenerator

            holds_job_weights = isinstance(generator, BuiltinGenerator) and config.control is None
            scorer = SameWeightsScorer(config, device, generator.model if holds_job_weights else None)
        self.worker = RolloutWorker(
            generator, max_in_flight=self.lag + 1, scorer=scorer, device=device, threaded=self.lag > 0
        )

    def prompts(self, step: int) -> list[Prompt]:
        """The whole prompt set of `step` (every rank's prompts, in prompt-id order)."""
        return self.task.prompts(step)

    def _mine(self, step: int) -> list[Prompt]:
        prompts = self.prompts(step)
        mine = [prompts[i] for i in self.prompt_ids]
        assert all(p.id == i for p, i in zip(mine, self.prompt_ids)), "prompt ids are positions in the step's set"
        return mine

    def _version(self, model: torch.nn.Module) -> tuple[dict, dict[str, str], dict | None]:
        """The model's current version as jobs carry it: (weights, fingerprints of what the
        generator is sent, the control's copy or None); collective under a sharded layout."""
        live = live_weights(model)
        control = self.config.control
        if control is not None and isinstance(live.get(PERTURBED_TENSOR), DTensor):
            live_full = {**live, PERTURBED_TENSOR: full_weight(live[PERTURBED_TENSOR])}
        else:
            live_full = live
        sent = generator_weights(live_full, control)  # `live` itself unless a control run
        weights = job_weights(live, self.plan, self.mesh)  # after: the fingerprints are of these bits
        fingerprint = trainer_fingerprint(sent)
        return weights, fingerprint, None if sent is live else {**weights, PERTURBED_TENSOR: sent[PERTURBED_TENSOR]}

    def _job(self, step: int, version: int, carried: tuple) -> RolloutJob:
        check_prompts(self.config, self.prompts(step))
        G, seed = self.config.task.samples_per_prompt, self.config.seed
        requests = [
            GenerationRequest(p.ids, SampleKey(seed, step, p.id, j)) for p in self._mine(step) for j in range(G)
        ]
        weights, fingerprint, sent = carried
        return RolloutJob(step, version, weights, fingerprint, requests, self.params, generator_weights=sent)

    def start(self, start_step: int, model: torch.nn.Module, restored: list[RolloutResult]) -> None:
        """Put back the rollouts a checkpoint held (this rank's part) and submit the jobs of the
        other steps start_step+1 .. start_step+1+lag, all from the current weights."""
        for result in restored:
            self.worker.put_result(self._my_part(result))
        carried = self._version(model)
        for step in range(start_step + 1, start_step + 2 + self.lag):
            if step not in {r.step for r in restored}:
                assert rollout_version(step, self.lag) == start_step, (step, self.lag, start_step)
                self.worker.submit(self._job(step, start_step, carried))

    def take(self, step: int) -> RolloutResult:
        return self.worker.take(step)

    def submit_after(self, step: int, model: torch.nn.Module) -> None:
        """After step `step`: its weights (policy version `step`) generate step + 1 + lag."""
        self.worker.submit(self._job(step + 1 + self.lag, step, self._version(model)))

    def groups(self, result: RolloutResult, step: int) -> list[tuple[Prompt, list[Sample]]]:
        """This rank's prompts of `step` with their G samples each, in prompt order."""
        by_key = {(s.key.prompt_id, s.key.sample_index): s for s in result.samples}
        groups = []
        for p in self._mine(step):
            samples = [by_key[(p.id, j)] for j in range(self.config.task.samples_per_prompt)]
            assert all(s.prompt_ids == p.ids for s in samples), p
            groups.append((p, samples))
        return groups

    def pending(self, step: int) -> list[RolloutResult]:
        """The rollouts of steps step+1 .. step+lag (waited for), every rank's merged in prompt
        order, on every rank (collective when W > 1)."""
        results = self.worker.finished(list(range(step + 1, step + 1 + self.lag)))
        if self.world_size == 1:
            return results
        box: list = [None] * self.world_size
        dist.all_gather_object(box, [r.to_state() for r in results], group=self.group)
        merged = []
        for parts in zip(*box):
            parts = [RolloutResult.from_state(p) for p in parts]
            first = parts[0]
            assert all(
                p.generator_fingerprint == first.generator_fingerprint and p.version == first.version for p in parts
            )
            samples = [s for p in parts for s in p.samples]
            extra = {k: [t for p in parts for t in p.extra[k]] for k in first.extra}
            order = sorted(range(len(samples)), key=lambda i: samples[i].key)  # (prompt id, sample index)
            samples = [samples[i] for i in order]
            extra = {k: [v[i] for i in order] for k, v in extra.items()}
            merged.append(RolloutResult(first.step, first.version, samples, first.generator_fingerprint, extra))
        return merged

    def _my_part(self, result: RolloutResult) -> RolloutResult:
        mine = set(self.prompt_ids)
        keep = [i for i, s in enumerate(result.samples) if s.key.prompt_id in mine]
        return RolloutResult(
            result.step,
            result.version,
            [result.samples[i] for i in keep],
            result.generator_fingerprint,
            {k: [v[i] for i in keep] for k, v in result.extra.items()},
        )

    def close(self) -> None:
        self.worker.close()
        if hasattr(self.generator, "close"):
            self.generator.close()
