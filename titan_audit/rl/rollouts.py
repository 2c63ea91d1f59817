"""Asynchronous rollouts with a deterministic lag: a generator thread fed by weight snapshots.

The scheme. Policy version v = the weights after v optimizer steps (v = 0: the initial weights).
With lag L the rollouts of RL step k (steps count from 1) are generated from version
`rollout_version(k, L) = max(0, k - 1 - L)`; L = 0 is synchronous on-policy (step k samples from
the weights it is about to update). The trainer (main thread) drives everything:

    start:        submit the jobs of steps 1 .. L+1 (all version 0)
    after step k: the weights of version k (rl/weights.py `job_weights`: at L = 0 the trainer's
                  live tensors, at L > 0 a snapshot) with their fingerprints, and submit the job
                  of step k + 1 + L, whose version is k
    at step k:    take(k) blocks until the rollouts of step k are done

A job carries everything its result depends on: its step, the weights and their version, the
requests (prompt ids + SampleKeys) and the sampling params. The worker thread runs jobs one at a
time in submission order: load the weights into the generator (weight sync; a generator that
shares the trainer's module only marks the version), fingerprint the generator's weights against
the trainer's (computed when the job was made, from the shards each rank holds: rl/weights.py
`shard_fingerprints`; a mismatch fails the job with a `WeightSyncError` naming the first
differing tensor), generate. (A constructed control run, rl/control.py, sends the generator a
perturbed copy instead, `RolloutJob.generator_weights`, fingerprinted as sent.) Generation is a
pure function of (weights, requests, params) (keyed sampling, batch-invariant generator), so a
job's result never depends on when it ran, how long the trainer took, or what ran concurrently:
the trajectory is fixed by (config, L) alone. At most L + 1 jobs are in flight, holding at most
L + 1 snapshots (none at L = 0); the config bounds L by `rollout.buffer`.

L = 0 runs unthreaded (`threaded=False`, what RolloutSchedule picks): the trainer would wait for
each job right after submitting it, so `take` runs the submitted jobs itself, in the trainer's
thread and in submission order, with the same steps (delay hook, crash point, weight sync and its
fingerprint check, generation) and the same results. Why not a thread that sits idle: every thread
that runs an OpenMP parallel region gets its own team of workers, and once libgomp manages more
threads than there are cores its idle workers sleep after ~1000 spins instead of ~300k, so each
parallel region of the step paid a futex wake-up. On the 2-core bench machine that made
`parallel.threads=2` slower than 1 (1.03x, `titan-audit bench rl`); without the second team 2
threads take 0.70-0.72x of 1 thread's step.

Checkpoints: after step k the rollouts of steps k+1 .. k+L are in flight; `finished(steps)`
waits for them and they go into the checkpoint as plain data (`to_state` / `from_state`: tokens,
log-prob bits, versions, fingerprints), so a resume restores them instead of regenerating from
weights it no longer has, and submits step k+1+L from the restored version-k weights.

Test hooks (never set in normal runs): `TITAN_AUDIT_RL_TEST_DELAY_MS=M` sleeps a random
0..M ms (an unseeded RNG: real timing noise) before every job in the worker and before every
training step in the trainer (`random_delay`); `TITAN_AUDIT_CRASH_AT=rl.rollout:K` SIGKILLs the
process inside the job of step K (trainer/crash.py).

Device: on `parallel.device = "cuda"` the worker thread makes the rank's GPU its current device
(CUDA's current device is per thread; kernels launched on the current device must find the
weights there). Snapshots stay on the trainer's device; fingerprints copy their bytes.

Collectives: a weight sync from sharded weights gathers each parameter over its mesh. At L = 0
that runs in the trainer's thread (unthreaded), every rank at the same point; at L > 0 from the
shard snapshots' own process group (rl/weights.py `rollout_mesh`), every rank's worker in the
same job order, never the trainer's groups.

Errors: an exception inside a job (bad request, generator failure, weight mismatch) is kept and
re-raised in the trainer's thread by `take`, so the run stops with it; nothing is written by the
worker thread, so a failed rollout cannot touch the run directory.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from titan_audit.rl.generator import GenerationRequest, Generator, Sample, SampleKey, SamplingParams
from titan_audit.rl.weights import shard_fingerprints
from titan_audit.trainer.crash import crash_point

DELAY_ENV = "TITAN_AUDIT_RL_TEST_DELAY_MS"
_DELAY_RNG = random.Random()  # deliberately unseeded: the hook injects real timing noise


class WeightSyncError(RuntimeError):
    """The generator's weights after a sync differ from the trainer's snapshot."""


def rollout_version(step: int, lag: int) -> int:
    """The policy version whose weights generate the rollouts of RL step `step` (>= 1)."""
    return max(0, step - 1 - lag)


def random_delay() -> None:
    """The test hook (module docstring): sleep a random 0..M ms when the variable is set."""
    spec = os.environ.get(DELAY_ENV)
    if spec:
        time.sleep(_DELAY_RNG.uniform(0.0, float(spec)) / 1000.0)


def first_difference(expected: Mapping[str, str], actual: Mapping[str, str]) -> str | None:
    """The first tensor name (sorted) whose fingerprint differs or is missing on one side."""
    for name in sorted(expected.keys() | actual.keys()):
        if expected.get(name) != actual.get(name):
            return name
    return None


@dataclass
class RolloutJob:
    step: int
    version: int
    # the trainer's (rl/weights.py: live tensors at lag 0, a snapshot at lag > 0, DTensors when
    # sharded); None: the generator already holds `version`
    weights: dict[str, torch.Tensor] | None
    fingerprint: dict[str, str]  # the fingerprints of the weights the generator is sent
    requests: list[GenerationRequest]
    params: SamplingParams
    # what the generator is sent when it is not `weights` (a constructed control, rl/control.py);
    # None: `weights`. The same-weights scorer always recomputes with the trainer's `weights`.
    generator_weights: dict[str, torch.Tensor] | None = None

    @property
    def sent(self) -> dict[str, torch.Tensor] | None:
        """The weights the generator loads for this job."""
        return self.generator_weights if self.generator_weights is not None else self.weights


@dataclass
class RolloutResult:
    step: int
    version: int
    samples: list[Sample]
    generator_fingerprint: dict[str, str]
    extra: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # e.g. same-weights recomputation

    def to_state(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "generator_fingerprint": self.generator_fingerprint,
            "samples": [_sample_state(s) for s in self.samples],
            "extra": {k: [_bits(t) for t in v] for k, v in self.extra.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> RolloutResult:
        return cls(
            int(state["step"]),
            int(state["version"]),
            [_sample_from(s) for s in state["samples"]],
            dict(state["generator_fingerprint"]),
            {k: [_unbits(b) for b in v] for k, v in state.get("extra", {}).items()},
        )


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().to(torch.float32).contiguous().view(torch.int32).tolist()


def _unbits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def _sample_state(s: Sample) -> dict:
    k = s.key
    return {
        "key": [k.seed, k.step, k.prompt_id, k.sample_index],
        "prompt_ids": list(s.prompt_ids),
        "tokens": list(s.tokens),
        "logprobs": _bits(s.logprobs),
        "finish_reason": s.finish_reason,
        "policy_version": s.policy_version,
    }


def _sample_from(d: dict) -> Sample:
    return Sample(
        SampleKey(*(int(x) for x in d["key"])),
        tuple(d["prompt_ids"]),
        [int(t) for t in d["tokens"]],
        _unbits(d["logprobs"]),
        d["finish_reason"],
        int(d["policy_version"]),
    )


Scorer = Callable[[RolloutJob, list[Sample]], dict[str, list[torch.Tensor]]]


class RolloutWorker:
    """Runs `RolloutJob`s on a generator in one background thread, or (`threaded=False`) in the
    thread that takes their results (module docstring)."""

    def __init__(
        self,
        generator: Generator,
        *,
        max_in_flight: int,
        scorer: Scorer | None = None,
        device: torch.device | str = "cpu",
        threaded: bool = True,
    ) -> None:
        self.generator = generator
        self.device = torch.device(device)  # the thread's current CUDA device (Triton launches on it)
        self.max_in_flight = max_in_flight
        self.scorer = scorer
        self._jobs: queue.Queue[RolloutJob | None] = queue.Queue()
        self._done: dict[int, RolloutResult | BaseException] = {}
        self._submitted: set[int] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="titan-audit-rollouts", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ trainer side
    def submit(self, job: RolloutJob) -> None:
        with self._cond:
            assert job.step not in self._submitted and job.step not in self._done, job.step
            in_flight = len(self._submitted) + len(self._done)
            assert in_flight < self.max_in_flight, (in_flight, self.max_in_flight)
            self._submitted.add(job.step)
        self._jobs.put(job)

    def put_result(self, result: RolloutResult) -> None:
        """A finished result restored from a checkpoint."""
        with self._cond:
            assert result.step not in self._done and result.step not in self._submitted, result.step
            self._done[result.step] = result

    def take(self, step: int) -> RolloutResult:
        """Block until step `step`'s rollouts are done; they leave the worker. Re-raises a job's error."""
        result = self._wait(step)
        with self._cond:
            del self._done[step]
        if isinstance(result, BaseException):
            raise result
        return result

    def finished(self, steps: Sequence[int]) -> list[RolloutResult]:
        """Wait for these steps' rollouts and return them (they stay in the worker)."""
        out = []
        for step in steps:
            result = self._wait(step)
            if isinstance(result, BaseException):
                raise result
            out.append(result)
        return out

    def pending_steps(self) -> list[int]:
        with self._cond:
            return sorted(self._submitted | self._done.keys())

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()

    def _wait(self, step: int) -> RolloutResult | BaseException:
        with self._cond:
            if step not in self._submitted and step not in self._done:
                raise AssertionError(f"no rollouts of step {step} were submitted")
        if self._thread is None:  # unthreaded: run the jobs up to this one here, in submission order
            while step not in self._done:
                with torch.no_grad():
                    self._run_one(self._jobs.get_nowait())
        with self._cond:
            while step not in self._done:
                self._cond.wait()
            return self._done[step]

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local: the worker never builds autograd graphs
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run_one(job)

    def _run_one(self, job: RolloutJob) -> None:
        try:
            result: RolloutResult | BaseException = self._execute(job)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer thread
            result = error
        with self._cond:
            self._submitted.discard(job.step)
            self._done[job.step] = result
            self._cond.notify_all()

    def _execute(self, job: RolloutJob) -> RolloutResult:
        if self.device.type == "cuda":  # the current device is per thread: this rank's GPU, not GPU 0
            torch.cuda.set_device(self.device)
        random_delay()
        crash_point("rl.rollout", job.step)
        if job.sent is not None:
            self.generator.load_weights(job.sent, job.version)
        actual = self.generator.weights_fingerprint()
        differing = first_difference(job.fingerprint, actual)
        if differing is not None:
            raise WeightSyncError(
                f"weight sync for step {job.step} (policy version {job.version}): the generator's tensor "
                f"{differing!r} differs from the trainer's "
                f"({job.fingerprint.get(differing)} != {actual.get(differing)})"
            )
        if self.generator.policy_version != job.version:
            raise WeightSyncError(
                f"generator reports policy version {self.generator.policy_version}, expected {job.version}"
            )
        samples = self.generator.generate(job.requests, job.params) if job.requests else []
        for sample in samples:
            if sample.policy_version != job.version:
                raise WeightSyncError(
                    f"sample {sample.key} reports policy version {sample.policy_version}, expected {job.version}"
                )
        extra = self.scorer(job, samples) if self.scorer is not None else {}
        return RolloutResult(job.step, job.version, samples, actual, extra)


def trainer_fingerprint(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The fingerprints of the weights a job sends, from the pieces each rank holds (collective
    when some are DTensors: the trainer's thread, every rank at the same point)."""
    return shard_fingerprints(weights)
