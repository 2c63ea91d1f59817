"""`VllmGenerator`: the `Generator` contract (rl/generator.py) served by a real vLLM engine.

    gen = VllmGenerator(model, VllmGeneratorConfig(batch_invariant=True))
    samples = gen.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=16))
    gen.load_weights(trainer_model.state_dict(), policy_version=step)   # in place, no restart
    gen.close()

What it guarantees (on top of the Generator contract):
- The engine runs our models/ transformer (`model.py`, attention over vLLM's paged cache in
  `attention.py`), with vLLM's scheduler: continuous batching (prefills and decodes of different
  requests in one step), chunked prefill (`max_num_batched_tokens`) and automatic prefix caching,
  each on by default.
- In batch-invariant mode (`batch_invariant=True`) each reported log-prob is bitwise equal to the
  trainer's recomputation `rl.logprobs.sequence_logprobs(model, prompts, completions, T)`, and
  the tokens are the built-in generator's for the same keys (`BuiltinGenerator` in BI mode): the
  logits of every token are the trainer's bits whatever vLLM batched with it or cached, and the
  token and its log-prob come from rl/sampling.py's keyed draw and our BI log_softmax inside
  vLLM's sampler (`sampler.py`). Tested in tests/rl/test_vllm_*.py. Its gemms sum in the gemm
  order of the process that starts the engine (`batch_invariant.current_gemm_order()` at start:
  in-process the same order, with multiprocessing passed to the workers by `plugin.py`).
- Its own weights: the constructor exports the given model once (`models.save_pretrained` into a
  temporary directory, removed by `close()`) for vLLM to load; afterwards `load_weights` copies a
  trainer state dict into the engine's parameters in place (`collective_rpc` into each worker:
  no engine restart, no file), resets vLLM's prefix cache (cached KV of the old weights must not
  serve the new ones) and records the policy version. `weights_fingerprint()` hashes the
  weights inside the engine (what rl/rollouts.py compares with the trainer's after every sync).
- Bad input raises ValueError naming the request before anything is generated.
- `implementation="vllm"` runs vLLM's own model code for the checkpoint's architecture (e.g.
  its Qwen3, its CPU kernels) on the same weights, still with our keyed sampler: the same model
  in other kernels, whose log-prob bits the tests report beside ours (whether any differs depends
  on those kernels on the CPU at hand). Weight sync is not offered there.

Engine: in-process by default (`multiprocessing=False`: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, a
few seconds to start); `multiprocessing=True` starts vLLM's engine-core and worker processes,
where our `vllm.general_plugins` entry point (`plugin.py`) registers the model and installs the
BI ops. Creating an in-process engine changes process state vLLM owns (a one-rank
torch.distributed group, `torch.set_num_threads`, the global RNG seeds): the generator restores
the thread count, the `torch.set_num_threads` function and the RNG states right away, and
`close()` tears the distributed group down again when it created it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from titan_audit import batch_invariant as bi
from titan_audit.audit import fingerprint
from titan_audit.models import save_pretrained
from titan_audit.models.transformer import Transformer
from titan_audit.rl.generator import GenerationRequest, Sample, SamplingParams, check_weights
from titan_audit.rl.requests import check_requests
from titan_audit.rl.vllm import plugin
from titan_audit.rl.vllm.model import ARCHITECTURE, CONFIG_KEY
from titan_audit.rl.vllm.sampler import request_args

SAMPLER = "titan_audit.rl.vllm.sampler:KeyedSampler"
WORKER_EXTENSION = "titan_audit.rl.vllm.generator.TitanWorkerExtension"


@dataclass(frozen=True)
class VllmGeneratorConfig:
    """batch_invariant: BI mode (bitwise log-probs, G4); implementation: "titan" (our model) or
    "vllm" (vLLM's own model code, reported beside ours); max_num_seqs: most requests running
    together; max_num_batched_tokens: tokens per engine step (a longer prompt is prefilled in
    chunks); block_size: KV-cache block (a multiple of 32 on CPU); kv_cache_memory_bytes: the
    cache's size; max_model_len: None = the model's max_position_embeddings; multiprocessing:
    vLLM's engine-core and worker processes instead of the in-process engine."""

    batch_invariant: bool = False
    implementation: Literal["titan", "vllm"] = "titan"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 32
    kv_cache_memory_bytes: int = 256 << 20
    max_model_len: int | None = None
    multiprocessing: bool = False

    def __post_init__(self) -> None:
        if self.implementation not in ("titan", "vllm"):
            raise ValueError(f"vllm generator implementation must be 'titan' or 'vllm', got {self.implementation!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"vllm generator {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 32 or self.block_size % 32:
            raise ValueError(
                f"vllm generator block_size must be a multiple of 32 (vLLM's CPU cache), got {self.block_size}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"vllm generator max_model_len must be >= 1 or None, got {self.max_model_len}")


class TitanWorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`), reached through
    `LLM.collective_rpc(name, args=...)` in every worker (any process)."""

    def titan_load_state(self, state: dict[str, torch.Tensor | tuple[str, list[int], bytes]]) -> int:
        own = self.model_runner.model.titan_state_dict()
        with torch.no_grad():
            for name, target in own.items():
                target.copy_(_unpack(state[name]))
        return len(own)

    def titan_status(self) -> dict[str, object]:
        """Where the worker runs and whether the BI ops are installed there outside any forward."""
        from titan_audit import batch_invariant

        return {
            "pid": os.getpid(),
            "batch_invariant_installed": batch_invariant.is_enabled(),
            "architecture": type(self.model_runner.model).__name__,
        }

    def titan_fingerprint(self) -> dict[str, str]:
        model = self.model_runner.model
        if not hasattr(model, "titan_state_dict"):
            raise ValueError("weights_fingerprint needs the titan-audit model (implementation='titan')")
        return {name: fingerprint(t) for name, t in model.titan_state_dict().items()}


def _pack(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as (dtype name, shape, raw bytes): what crosses vLLM's process boundary intact
    (its msgpack encoder turns a tensor inside a dict into a plain list)."""
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()


def _unpack(value: torch.Tensor | tuple | list) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    dtype, shape, raw = value
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


@contextlib.contextmanager
def scoped_environment(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def keep_process_state():
    """Undo what an in-process vLLM engine changes in this process (see the module doc)."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    rng, py_rng = torch.random.get_rng_state(), random.getstate()
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover
        np = np_rng = None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        random.setstate(py_rng)
        if np is not None:
            np.random.set_state(np_rng)


class VllmGenerator:
    """The `Generator` over a vLLM engine running our model (see the module doc)."""

    def __init__(
        self, model: Transformer, config: VllmGeneratorConfig | None = None, *, policy_version: int = 0
    ) -> None:
        from titan_audit.rl.vllm import require

        require()
        if not isinstance(model, Transformer):
            raise ValueError(f"VllmGenerator needs a models.Transformer, got {type(model).__name__}")
        if model.output_weight.dtype != torch.float32 or model.compute_dtype not in (None, torch.float32):
            raise ValueError("VllmGenerator runs float32 models only")
        if not isinstance(policy_version, int):
            raise ValueError(f"policy_version must be an int, got {policy_version!r}")
        self.config = config or VllmGeneratorConfig()
        self.model_config = model.config
        self.max_model_len = min(
            self.config.max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings
        )
        self._names = {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}
        self._lock = threading.Lock()
        self._policy_version = policy_version
        self._dir = tempfile.TemporaryDirectory(prefix="titan-audit-vllm-")
        self.llm = None
        try:
            save_pretrained(model, self._dir.name, overwrite=True)
            self.llm, self._owns_dist = self._start()
        except BaseException:
            self._dir.cleanup()
            raise

    def _start(self):
        import vllm

        plugin.register()  # this process (also when vLLM's plugin loading is restricted)
        cfg = self.config
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if cfg.multiprocessing else "0"}
        if cfg.batch_invariant:
            env[plugin.BATCH_INVARIANT_ENV] = "1"
            env[plugin.PARENT_PID_ENV] = str(os.getpid())
            env[plugin.GEMM_ORDER_ENV] = bi.current_gemm_order()  # the workers follow this process's order
        extra = {}
        if cfg.implementation == "titan":
            extra = {
                "hf_overrides": {"architectures": [ARCHITECTURE]},
                "additional_config": {CONFIG_KEY: {"batch_invariant": cfg.batch_invariant}},
            }
        owns_dist = not torch.distributed.is_initialized()
        with scoped_environment(env), keep_process_state():
            llm = vllm.LLM(
                model=self._dir.name,
                skip_tokenizer_init=True,
                dtype="float32",
                enforce_eager=True,
                seed=0,
                max_model_len=self.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=max(
                    cfg.max_num_batched_tokens, 1 if cfg.enable_chunked_prefill else self.max_model_len
                ),
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                enable_prefix_caching=cfg.enable_prefix_caching,
                block_size=cfg.block_size,
                kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                logits_processors=[SAMPLER],
                logprobs_mode="processed_logits",
                async_scheduling=False,
                worker_extension_cls=WORKER_EXTENSION,
                **extra,
            )
        return llm, owns_dist and torch.distributed.is_initialized()

    def close(self) -> None:
        """Shut the engine down (its processes, the distributed group it created) and remove the
        exported checkpoint. Idempotent."""
        llm, self.llm = self.llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            if self._owns_dist:
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                destroy_model_parallel()
                destroy_distributed_environment()
        self._dir.cleanup()

    def __enter__(self) -> VllmGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine(self):
        if self.llm is None:
            raise ValueError("this VllmGenerator is closed")
        return self.llm

    # -- weights -------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._policy_version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Copy a full models/ state dict into the engine's weights in place, then reset the
        prefix cache; ValueError naming the first offending tensor."""
        if self.config.implementation != "titan":
            raise ValueError("load_weights needs the titan-audit model (implementation='titan')")
        check_weights(state_dict, self._names, policy_version)
        if self.config.multiprocessing:
            state = {name: _pack(t) for name, t in state_dict.items()}
        else:
            state = {name: t.detach() for name, t in state_dict.items()}
        with self._lock:
            llm = self._engine()
            llm.collective_rpc("titan_load_state", args=(state,))
            llm.reset_prefix_cache()
            self._policy_version = policy_version

    def weights_fingerprint(self) -> dict[str, str]:
        with self._lock:
            return dict(self._engine().collective_rpc("titan_fingerprint")[0])

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Sample]:
        """One sample per request, in request order (see the module doc)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        requests = list(requests)
        self._check(requests, params)
        if not requests:
            return []
        return self._generate(requests, params, [0] * len(requests))

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams, offsets: list[int]) -> list[Sample]:
        """generate(), each request's first new token at decode position offsets[i] (sampler.py)."""
        import vllm

        stop = [int(t) for t in params.stop_token_ids]
        vllm_params = [
            vllm.SamplingParams(
                n=1,
                temperature=0.0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=stop,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                extra_args={CONFIG_KEY: request_args(r.key, params, offset)},
            )
            for r, offset in zip(requests, offsets)
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in r.prompt_ids]} for r in requests]
        # in-process, the whole call in BI mode (as the built-in generator does): the model's and the
        # sampler's own `enabled()` blocks are then no-ops instead of installing the ops every step
        mode = (
            bi.enabled()
            if self.config.batch_invariant and not self.config.multiprocessing
            else contextlib.nullcontext()
        )
        with self._lock, mode:
            outputs = self._engine().generate(prompts, vllm_params, use_tqdm=False)
            version = self._policy_version
        assert len(outputs) == len(requests), (len(outputs), len(requests))
        return [self._sample(r, o, version) for r, o in zip(requests, outputs)]

    def continue_samples(self, samples: Sequence[Sample], params: SamplingParams, upto: Sequence[int]) -> list[Sample]:
        """For each sample, a fresh request whose prompt is its prompt + its first upto[i] tokens,
        drawn from decode position upto[i] with its key (vLLM prefills that whole prompt): in BI
        mode it continues the sample with the same tokens and log-probs (the parity trio's
        decode-vs-prefill check). `prompt_ids` of the results hold the extended prompts."""
        requests = []
        for sample, t in zip(samples, upto, strict=True):
            if not 0 <= t <= len(sample.tokens):
                raise ValueError(f"sample {sample.key}: cannot continue after {t} of its {len(sample.tokens)} tokens")
            requests.append(GenerationRequest((*sample.prompt_ids, *sample.tokens[:t]), sample.key))
        self._check(requests, params, distinct_prompts=False)
        return self._generate(requests, params, [int(t) for t in upto]) if requests else []

    @staticmethod
    def _sample(request: GenerationRequest, output, version: int) -> Sample:
        completion = output.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), request.key
        logprobs = [entry[token].logprob for token, entry in zip(tokens, completion.logprobs)]
        reason = completion.finish_reason
        assert reason in ("stop", "length"), (request.key, reason)
        return Sample(
            key=request.key,
            prompt_ids=tuple(int(t) for t in request.prompt_ids),
            tokens=tokens,
            logprobs=torch.tensor(logprobs, dtype=torch.float32),
            finish_reason=reason,
            policy_version=version,
        )

    def _check(self, requests: list[GenerationRequest], params: SamplingParams, distinct_prompts: bool = True) -> None:
        check_requests(
            requests,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            "max_model_len",
            distinct_prompts=distinct_prompts,
        )
