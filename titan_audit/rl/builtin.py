"""The built-in generator: continuous batching over models/ with a paged KV cache.

    gen = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True))
    samples = gen.generate(requests, SamplingParams(temperature=0.7, max_new_tokens=32))
    gen.load_weights(trainer_model.state_dict(), policy_version=step)
    gen = BuiltinGenerator(model, config, share=True)    # generates with `model` itself, no copy

What it guarantees (on top of the `Generator` contract, rl/generator.py):
- Its own model copy: the constructor copies the given model's weights; only `load_weights`
  changes them afterwards (the trainer may keep updating its own model). A sharded source (TP or
  FSDP2 DTensors) is copied parameter by parameter, each one's full tensor gathered in turn
  (collective: every rank of its mesh loads together), never the whole model at once.
- `share=True`: no copy; it generates with the given module itself (under no_grad, never
  inference mode: tensors a forward caches must stay usable by the trainer's autograd), and
  `load_weights` accepts only that module's own tensors (it marks the version; anything else is
  a ValueError, since copying it in would overwrite the trainer's weights). For a caller that
  changes no weight while a rollout runs (the RL loop at lag 0, rl/weights.py).
- In batch-invariant mode (`batch_invariant=True`: every model call runs inside
  `titan_audit.batch_invariant.enabled()`) each reported log-prob is bitwise equal to the
  trainer's recomputation `rl.logprobs.sequence_logprobs(model, prompts, completions,
  temperature)` (one full forward of prompt + completion, no cache, BI log_softmax of
  logits / temperature): a token's logits are bitwise the same from a paged-cache prefill or
  decode in any batch as from a full forward (models/), and the log-softmax is the same BI op on
  the same row (guarantee G4). A sample's tokens are the same alone, in any batch and in any
  arrival order: they are drawn from those logits with the keyed uniforms of rl/sampling.py.
  With `batch_invariant=False` the model runs in the caller's mode (native ops outside BI mode):
  the same schedule and sampling rule, without the bitwise promise.
- Bad input raises ValueError naming the request before anything is generated.

Scheduling (one `generate` call; every iteration of the loop):
1. decode: the running samples (at most `max_batch_size`) take one step together, one model call
   [B, 1] on `PagedKVCache.batch(...)`; each draws its next token; a sample that drew a stop token
   (finish_reason "stop") or reached max_new_tokens ("length") leaves the batch and releases its
   blocks at once;
2. start: prompts already prefilled start more of their samples into the freed slots;
3. admit and prefill: when no prefilled prompt still waits for slots, new prompts (in request
   order) are admitted while slots and blocks allow, prefilled together (the model gives every
   row of a call the same number of new tokens, so prompts of different lengths are
   right-padded into one call per bucket in which padding at most doubles the tokens, and each
   sequence is then truncated to its prompt), and their samples started.
So requests join and leave the running batch at every decode step, and the prefill of new
prompts shares the iteration with the decode of the running ones.
A prompt's n samples (requests with the same (seed, step, prompt_id)) share one prefill: the
prompt is prefilled once into its own sequence, whose logits at the last prompt position give
every sample its first token; each sample then continues in a `fork` of that sequence (the last
one takes the prompt's sequence over). Blocks are reserved per sample for its worst case
(prompt + max_new_tokens), so the cache never runs out mid-decode and nothing is preempted.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from titan_audit import batch_invariant as bi
from titan_audit.audit import fingerprint
from titan_audit.models import ops
from titan_audit.models.kv_cache import PagedKVCache
from titan_audit.models.transformer import Transformer
from titan_audit.rl.generator import FinishReason, GenerationRequest, Sample, SamplingParams, check_weights
from titan_audit.rl.requests import check_requests
from titan_audit.rl.sampling import sample_rows, scale_logits, stream_key, uniform_from_stream
from titan_audit.rl.weights import full_weight, shares_storage


@dataclass(frozen=True)
class BuiltinGeneratorConfig:
    """batch_invariant: run the model in BI mode (bitwise log-probs, G4); max_batch_size: most
    samples decoding together; block_size: tokens per KV-cache block; num_blocks: the cache's
    size in blocks (None: sized per call for max_batch_size samples of the longest request)."""

    batch_invariant: bool = False
    max_batch_size: int = 64
    block_size: int = 16
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"generator max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.block_size < 1:
            raise ValueError(f"generator block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"generator num_blocks must be >= 1 or None, got {self.num_blocks}")


@dataclass
class Iteration:
    """What one scheduler iteration did (request indices), for tests and tuning."""

    decoded: list[int] = field(default_factory=list)  # the decode batch
    prefilled: list[list[int]] = field(default_factory=list)  # per prefill call: its prompts' first request
    started: list[int] = field(default_factory=list)  # samples that got their first token
    finished: list[int] = field(default_factory=list)


@dataclass
class _Prompt:
    """A prompt and its samples (request indices in request order) not started yet."""

    prompt_ids: tuple[int, ...]
    requests: list[int]
    next: int = 0
    seq: int | None = None  # its cache sequence once prefilled
    scaled_1V: torch.Tensor | None = None  # temperature-scaled logits after the last prompt token
    logprobs_V: torch.Tensor | None = None

    @property
    def remaining(self) -> int:
        return len(self.requests) - self.next


@dataclass
class _Running:
    request: int
    seq: int
    stream: bytes
    tokens: list[int]
    logprobs: list[float]
    blocks: int  # its reservation


class BuiltinGenerator:
    """The `Generator` over models/ (see the module doc)."""

    def __init__(
        self,
        model: Transformer,
        config: BuiltinGeneratorConfig | None = None,
        *,
        policy_version: int = 0,
        share: bool = False,
    ) -> None:
        if not isinstance(model, Transformer):
            raise ValueError(f"BuiltinGenerator needs a models.Transformer, got {type(model).__name__}")
        self.config = config or BuiltinGeneratorConfig()
        self.shared = share
        self._lock = threading.Lock()
        self._cache: PagedKVCache | None = None
        self._policy_version = 0
        self.last_schedule: list[Iteration] = []
        if share:
            if any(isinstance(p, DTensor) for p in model.parameters()):
                raise ValueError(
                    "BuiltinGenerator(share=True) needs an unsharded model: a sharded forward communicates"
                )
            self.model = model
            self._policy_version = policy_version
            return
        weight = model.output_weight
        with torch.device("meta"):
            own = Transformer(model.config)
        own = own.to_empty(device=weight.device).to(weight.dtype)
        own.set_compute_dtype(model.compute_dtype)
        self.model = own.eval().requires_grad_(False)
        self.load_weights(model.state_dict(), policy_version)  # parameter by parameter (full tensors)

    # -- weights -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._policy_version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Copy a state dict of the models/ model (same names, shapes, dtypes; full tensors or
        DTensors, each gathered in turn) into the generator's model; ValueError naming the first
        offending tensor. Shared (`share=True`): only the module's own tensors, nothing copied."""
        own = self.model.state_dict()
        check_weights(state_dict, {name: (t.dtype, tuple(t.shape)) for name, t in own.items()}, policy_version)
        if self.shared:
            if not shares_storage(self.model, state_dict):
                raise ValueError(
                    "load_weights: this generator shares the trainer's module (share=True) and cannot load other "
                    "weights; build one with its own copy"
                )
            with self._lock:
                self._policy_version = policy_version
            return
        with self._lock, torch.no_grad():
            for name, target in own.items():
                target.copy_(full_weight(state_dict[name]))  # one parameter's full tensor at a time
            self._policy_version = policy_version

    def weights_fingerprint(self) -> dict[str, str]:
        with self._lock:
            return {name: fingerprint(t) for name, t in self.model.state_dict().items()}

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Sample]:
        """One sample per request, in request order (see the module doc)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        requests = list(requests)
        with self._lock:
            prompts = self._check(requests, params)
            if not requests:
                self.last_schedule = []
                return []
            cache = self._cache_for(requests, params)
            mode = bi.enabled() if self.config.batch_invariant else contextlib.nullcontext()
            try:
                grad_mode = torch.no_grad() if self.shared else torch.inference_mode()
                with grad_mode, mode:
                    return _Run(self, cache, requests, params, prompts).run()
            except BaseException:
                self._cache = None  # sequences may be left in it
                raise

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _check(self, requests: list[GenerationRequest], params: SamplingParams) -> list[_Prompt]:
        """Validate every request; the prompts, in order of their first request."""
        model_config = self.model.config
        groups = check_requests(
            requests, params, model_config.vocab_size, model_config.max_position_embeddings, "max_position_embeddings"
        )
        prompts = {group: _Prompt(ids, indices) for group, (ids, indices) in groups.items()}
        max_new = params.max_new_tokens
        if self.config.num_blocks is not None:
            for prompt in prompts.values():
                # one sample: it takes the prompt's blocks over; more: the prompt's sequence stays
                # while its first sample runs (if the others must wait for slots)
                length = len(prompt.prompt_ids)
                need = self._blocks(length + max_new) + (self._blocks(length) if len(prompt.requests) > 1 else 0)
                if need > self.config.num_blocks:
                    i = prompt.requests[0]
                    raise ValueError(
                        f"request {i} ({requests[i].key}): prompt of {length} tokens + max_new_tokens "
                        f"{max_new} needs {need} KV-cache blocks, more than the cache's capacity of "
                        f"{self.config.num_blocks} (block_size {self.config.block_size})"
                    )
        return list(prompts.values())

    def _cache_for(self, requests: list[GenerationRequest], params: SamplingParams) -> PagedKVCache:
        if self.config.num_blocks is not None:
            num_blocks = self.config.num_blocks
        else:
            longest = max(len(r.prompt_ids) for r in requests)
            slots = min(self.config.max_batch_size, len(requests))
            num_blocks = slots * self._blocks(longest + params.max_new_tokens) + self._blocks(longest)
        cache = self._cache
        if cache is None or cache.num_blocks < num_blocks:  # kept between calls (empty after each)
            weight = self.model.output_weight
            dtype = self.model.compute_dtype or weight.dtype
            cache = PagedKVCache(
                self.model.config, num_blocks, self.config.block_size, dtype=dtype, device=weight.device
            )
            self._cache = cache
        assert not cache.lengths and cache.num_free_blocks == cache.num_blocks
        return cache


class _Run:
    """The scheduler state of one generate call."""

    def __init__(
        self,
        gen: BuiltinGenerator,
        cache: PagedKVCache,
        requests: list[GenerationRequest],
        params: SamplingParams,
        prompts: list[_Prompt],
    ) -> None:
        self.gen = gen
        self.model = gen.model
        self.cache = cache
        self.requests = requests
        self.params = params
        self.device = gen.model.output_weight.device
        self.max_batch = gen.config.max_batch_size
        self.stop = frozenset(int(t) for t in params.stop_token_ids)
        self.waiting = deque(prompts)
        self.active: list[_Prompt] = []  # prefilled, samples still to start
        self.running: list[_Running] = []
        self.results: list[Sample | None] = [None] * len(requests)
        self.reserved = 0  # blocks reserved by live sequences (their worst case)
        self.next_seq = 0
        self.schedule: list[Iteration] = []
        gen.last_schedule = self.schedule

    # block reservations: a prompt's own sequence, and a sample's worst case
    def _prompt_blocks(self, prompt: _Prompt) -> int:
        return self.gen._blocks(len(prompt.prompt_ids))

    def _sample_blocks(self, prompt: _Prompt) -> int:
        return self.gen._blocks(len(prompt.prompt_ids) + self.params.max_new_tokens)

    def run(self) -> list[Sample]:
        while self.waiting or self.active or self.running:
            step = Iteration()
            self.schedule.append(step)
            if self.running:
                self._decode(step)
            for prompt in self.active:
                self._start(prompt, step)
            self.active = [p for p in self.active if p.remaining]
            if not self.active and self.waiting:
                admitted = self._admit()
                self._prefill(admitted, step)
                for prompt in admitted:
                    self._start(prompt, step)
                self.active = [p for p in admitted if p.remaining]
            assert step.decoded or step.started, "scheduler made no progress"
        assert not self.cache.lengths and self.reserved == 0
        assert all(s is not None for s in self.results)
        return list(self.results)

    def _token_logprobs(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled_BV = scale_logits(logits_BV, self.params.temperature)
        return scaled_BV, ops.log_softmax(scaled_BV, -1)

    def _decode(self, step: Iteration) -> None:
        running = self.running
        tokens_B1 = torch.tensor([[r.tokens[-1]] for r in running], dtype=torch.long, device=self.device)
        logits_B1V = self.model(tokens_B1, cache=self.cache.batch([r.seq for r in running]))
        scaled_BV, logprobs_BV = self._token_logprobs(logits_B1V[:, 0])
        uniforms = [uniform_from_stream(r.stream, len(r.tokens)) for r in running]
        drawn = sample_rows(scaled_BV, uniforms, self.params).tolist()
        picked = logprobs_BV.gather(1, torch.tensor(drawn, device=self.device)[:, None]).squeeze(1).tolist()
        step.decoded = [r.request for r in running]
        still = []
        for r, token, logprob in zip(running, drawn, picked):
            r.tokens.append(token)
            r.logprobs.append(logprob)
            reason = self._finish_reason(r)
            if reason is None:
                still.append(r)
            else:
                self.cache.release(r.seq)
                self.reserved -= r.blocks
                self._finish(r, reason, step)
        self.running = still

    def _finish_reason(self, r: _Running) -> FinishReason | None:
        if r.tokens[-1] in self.stop:
            return "stop"
        if len(r.tokens) >= self.params.max_new_tokens:
            return "length"
        return None

    def _finish(self, r: _Running, reason: FinishReason, step: Iteration) -> None:
        request = self.requests[r.request]
        self.results[r.request] = Sample(
            key=request.key,
            prompt_ids=tuple(int(t) for t in request.prompt_ids),
            tokens=r.tokens,
            logprobs=torch.tensor(r.logprobs, dtype=torch.float32),
            finish_reason=reason,
            policy_version=self.gen.policy_version,
        )
        step.finished.append(r.request)

    def _admit(self) -> list[_Prompt]:
        """Take prompts off the queue while slots and blocks allow at least one sample each.

        A prompt whose samples all start now costs n * (sample blocks): its own sequence is
        forked n - 1 times and then taken over (the prompt's blocks never exceed a sample's). One
        that must wait for more slots keeps its sequence: prompt blocks + started samples."""
        slots = self.max_batch - len(self.running)
        blocks = self.cache.num_blocks - self.reserved
        admitted = []
        while self.waiting and slots >= 1:
            prompt = self.waiting[0]
            prompt_blocks, sample_blocks = self._prompt_blocks(prompt), self._sample_blocks(prompt)
            count = prompt.remaining
            if count <= slots and count * sample_blocks <= blocks:
                starts, cost = count, count * sample_blocks
            else:
                starts = min(count, slots, max(0, blocks - prompt_blocks) // sample_blocks)
                cost = prompt_blocks + starts * sample_blocks
            if starts == 0:
                break
            self.waiting.popleft()
            admitted.append(prompt)
            self.reserved += prompt_blocks
            slots -= starts
            blocks -= cost
            if starts < count:
                break  # it waits for slots: admit nothing after it
        return admitted

    def _prefill(self, prompts: list[_Prompt], step: Iteration) -> None:
        """Prefill the prompts: one model call per bucket of `_buckets`, right-padded to the
        bucket's longest prompt, then each sequence truncated to its prompt (the padding's cache
        entries lie beyond it, invisible to later queries; in BI mode a row's logits do not
        depend on the invisible padding keys, so the bits are those of an unpadded prefill)."""
        for bucket in self._buckets(prompts):
            longest = max(len(p.prompt_ids) for p in bucket)
            if self.cache.num_free_blocks < len(bucket) * self.gen._blocks(longest):
                # not enough free blocks for the padding now: one call per prompt length
                by_length: dict[int, list[_Prompt]] = {}
                for prompt in bucket:
                    by_length.setdefault(len(prompt.prompt_ids), []).append(prompt)
                for group in by_length.values():
                    self._prefill_call(group, step)
            else:
                self._prefill_call(bucket, step)

    @staticmethod
    def _buckets(prompts: list[_Prompt]) -> list[list[_Prompt]]:
        """Prompts grouped (longest first) so that padding at most doubles a call's tokens."""
        buckets: list[list[_Prompt]] = []
        real = 0
        for prompt in sorted(prompts, key=lambda p: -len(p.prompt_ids)):
            length = len(prompt.prompt_ids)
            if buckets and (len(buckets[-1]) + 1) * len(buckets[-1][0].prompt_ids) <= 2 * (real + length):
                buckets[-1].append(prompt)
                real += length
            else:
                buckets.append([prompt])
                real = length
        return buckets

    def _prefill_call(self, prompts: list[_Prompt], step: Iteration) -> None:
        lengths = [len(p.prompt_ids) for p in prompts]
        longest = max(lengths)
        for prompt in prompts:
            prompt.seq = self._new_seq()
            self.cache.add(prompt.seq)
        tokens_GL = torch.zeros(len(prompts), longest, dtype=torch.long)
        for g, prompt in enumerate(prompts):
            tokens_GL[g, : lengths[g]] = torch.tensor(prompt.prompt_ids, dtype=torch.long)
        # the head at each prompt's last position only (row g * longest + length - 1; the same
        # bits as those rows of the full logits, models/head_rows.py)
        last_G = torch.tensor([g * longest + n - 1 for g, n in enumerate(lengths)], device=self.device)
        cache = self.cache.batch([p.seq for p in prompts])
        logits_GV = self.model(tokens_GL.to(self.device), cache=cache, logits_rows=last_G)
        scaled_GV, logprobs_GV = self._token_logprobs(logits_GV)
        for g, prompt in enumerate(prompts):
            self.cache.truncate(prompt.seq, lengths[g])
            prompt.scaled_1V = scaled_GV[g : g + 1]
            prompt.logprobs_V = logprobs_GV[g]
        step.prefilled.append([p.requests[0] for p in prompts])

    def _new_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq

    def _start(self, prompt: _Prompt, step: Iteration) -> None:
        """Start as many of the prompt's remaining samples as slots and blocks allow."""
        prompt_blocks, sample_blocks = self._prompt_blocks(prompt), self._sample_blocks(prompt)
        count, extra = 0, 0
        while count < prompt.remaining and len(self.running) + count < self.max_batch:
            last = count == prompt.remaining - 1
            need = sample_blocks - prompt_blocks if last else sample_blocks
            if self.reserved + extra + need > self.cache.num_blocks:
                break
            extra += need
            count += 1
        if count == 0:
            return
        indices = prompt.requests[prompt.next : prompt.next + count]
        streams = [stream_key(self.requests[i].key) for i in indices]
        uniforms = [uniform_from_stream(s, 0) for s in streams]
        drawn = sample_rows(prompt.scaled_1V.expand(count, -1), uniforms, self.params).tolist()
        for index, stream, token in zip(indices, streams, drawn):
            prompt.next += 1
            r = _Running(index, -1, stream, [token], [float(prompt.logprobs_V[token])], sample_blocks)
            step.started.append(index)
            reason = self._finish_reason(r)
            if reason is not None:
                self._finish(r, reason, step)
                continue
            if prompt.remaining == 0:  # the last sample takes the prompt's sequence over
                r.seq = prompt.seq
                self.reserved += sample_blocks - prompt_blocks
                prompt.seq = None
            else:
                r.seq = self._new_seq()
                self.cache.fork(prompt.seq, r.seq)
                self.reserved += sample_blocks
            self.running.append(r)
        if prompt.remaining == 0 and prompt.seq is not None:
            self.cache.release(prompt.seq)
            self.reserved -= prompt_blocks
            prompt.seq = None
        if prompt.remaining == 0:
            prompt.scaled_1V = prompt.logprobs_V = None
