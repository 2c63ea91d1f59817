"""`bench generate`: tokens/s of the built-in generator in BI mode against the same generator on
native ops, and against a plain HF-transformers `generate` of the same model; with
`--generator vllm` (`BenchOptions.generator`), our BI model inside vLLM against vLLM's default
mode on the same weights (`vllm_generate_suite`, target <= VLLM_TARGET_RATIO, 1.25x).

Workload (one timed call): tiny-dense (deterministic init, seed 0), B prompts of 32 random tokens
(distinct prompt ids, one sample each), 32 new tokens per sample by sampling at temperature 1.0
without top-k/top-p and without stop tokens, so every call decodes a batch of exactly B
sequences for 32 steps after prefilling the B prompts. `--quick`: B = 8, 8-token prompts,
4 new tokens, one repeat (a smoke run, figures not meaningful).

Cases per decode batch B in {8, 32, 64}:
- `generate B=<B>`: baseline `builtin generator, native ops`, candidate `builtin generator, BI
  mode` (`BuiltinGeneratorConfig(batch_invariant=True)`, whose log-probs equal the trainer's
  bitwise). Target: BI time <= 1.25x native.
- `generate B=<B> vs HF transformers`: baseline `HF transformers generate` (the same weights
  through `models.save_pretrained` and `AutoModelForCausalLM.from_pretrained`, do_sample with
  top_k=0, min_new_tokens = max_new_tokens, KV cache on), candidate the built-in generator in BI
  mode; no target. Skipped when transformers is not installed.
- `generate qwen3-0.6b widths L=2 B=8` (the widths of qwen3-0.6b, hidden 1024, 16/8 heads, head_dim
  128, vocab 151936 tied, with 2 layers, deterministic init seed 0; `REAL_WIDTH`): the built-in
  generator BI mode against native ops on the same workload at B = 8. Target: TARGET_RATIO.
  Left out of `--quick` (the init of the ~187M-parameter model alone takes seconds).
- `decode S=<S> B=<B>` for S in {256, 1024, 4096} cached tokens (`DECODE_LENGTHS`), B = 8
  (`--quick`: S = 256, B = 2): one BI decode step of B sequences of S cached tokens each in the
  paged KV cache (tiny-dense widths, max_position_embeddings raised to fit), the cache truncated
  back to S after each step. Baseline `paged cache, dense gather` (each layer copies the rows'
  blocks into dense k/v, `PagedKeys.gather()`, then BI attention: the read before the paged
  kernel), candidate `paged cache, read in place` (`ops.paged_attention`: the kernel reads the
  blocks through the block table); no target. Extra keys `cached_tokens`, `decode_batch`,
  `baseline_ms_per_token`, `candidate_ms_per_token` and `logits_bitwise_equal` (both sides'
  logits of one step compared as bits: true by construction).
Extra keys: `baseline_tokens_per_s`, `candidate_tokens_per_s` (new tokens per second of each side),
`new_tokens` (per call), and on the HF case `builtin_native_tokens_per_s`.
The three sides of one B are timed interleaved (bench/core.py), so noise hits them alike. A BI
side's timed batches run with the BI mode installed around them (BI_MODE), as in an RL run that
installs it once; the vLLM cases report one install and removal as `bi_mode_install_s`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
import time
from collections.abc import Callable

import torch

from titan_audit import batch_invariant, models
from titan_audit.bench.core import BenchOptions, Case, time_interleaved
from titan_audit.models.kv_cache import PagedKVCache
from titan_audit.models.presets import get_preset
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams

TARGET_RATIO = 1.25
BATCHES = [8, 32, 64]
PROMPT_LEN, NEW_TOKENS = 32, 32
QUICK_BATCHES = [8]
QUICK_PROMPT_LEN, QUICK_NEW_TOKENS = 8, 4
REAL_WIDTH = {"preset": "qwen3-0.6b", "num_hidden_layers": 2}  # the preset's widths, 2 layers
REAL_WIDTH_BATCH = 8
NATIVE, BI, HF = "builtin generator, native ops", "builtin generator, BI mode", "HF transformers generate"
DECODE_LENGTHS, DECODE_BATCH = [256, 1024, 4096], 8
QUICK_DECODE_LENGTHS, QUICK_DECODE_BATCH = [256], 2
DECODE_BLOCK_SIZE = 16  # the built-in generator's default
GATHER, IN_PLACE = "paged cache, dense gather", "paged cache, read in place"
# The BI sides run with the mode installed around each timed batch (bench/core.time_interleaved):
# a run installs it once, while a side alternating with a native one would pay an install and a
# removal (6-13 ms on the 2-core EPYC, `bi_mode_install_s` of the vLLM cases) on every call.
BI_MODE = batch_invariant.enabled


def _modes(sides: dict) -> list:
    """time_interleaved's per-side modes: BI_MODE for the BI sides (built-in or vLLM), None else."""
    return [BI_MODE if side in (BI, VLLM_BI) else None for side in sides]


def _hf_generate(
    model: models.Transformer, tmp: str, prompts_BT: torch.Tensor, new_tokens: int
) -> Callable[[], object]:
    import transformers

    models.save_pretrained(model, tmp)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()
    attention_mask = torch.ones_like(prompts_BT)

    def run() -> object:
        with torch.inference_mode():
            return hf_model.generate(
                input_ids=prompts_BT,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                eos_token_id=None,
                use_cache=True,
            )

    return run


def _workload(options: BenchOptions) -> tuple[int, int, BenchOptions, models.Transformer, SamplingParams]:
    """What every generate case shares: prompt length, new tokens per sample, the timing options,
    the model (tiny-dense, seed 0) and the sampling params."""
    new_tokens = QUICK_NEW_TOKENS if options.quick else NEW_TOKENS
    repeats = 1 if options.quick else options.repeats
    timing = BenchOptions(quick=options.quick, repeats=repeats, min_batch_s=options.min_batch_s)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    prompt_len = QUICK_PROMPT_LEN if options.quick else PROMPT_LEN
    return prompt_len, new_tokens, timing, models.build("tiny-dense", seed=0), params


def real_width_config() -> models.ModelConfig:
    """The real-width case's model: the preset's widths with REAL_WIDTH's layer count."""
    return dataclasses.replace(get_preset(REAL_WIDTH["preset"]), num_hidden_layers=REAL_WIDTH["num_hidden_layers"])


def mode_install_seconds(repeats: int = 3) -> float:
    """Seconds to install and remove the batch-invariant mode once (min of `repeats`), from off."""
    assert not batch_invariant.is_enabled()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with batch_invariant.enabled():
            pass
        best = min(best, time.perf_counter() - start)
    return best


def _requests(prompts_BT: torch.Tensor) -> list[GenerationRequest]:
    return [GenerationRequest(tuple(row), SampleKey(0, 0, i, 0)) for i, row in enumerate(prompts_BT.tolist())]


def generate_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    if options.generator == "vllm":
        return vllm_generate_suite(options, progress)
    batches = QUICK_BATCHES if options.quick else BATCHES
    prompt_len, new_tokens, timing, model, params = _workload(options)
    native = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=False, max_batch_size=max(batches)))
    bi = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=max(batches)))
    has_hf = importlib.util.find_spec("transformers") is not None
    g = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-generate-") as tmp:
        for batch in batches:
            prompts_BT = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
            requests = _requests(prompts_BT)
            sides = {
                NATIVE: lambda: native.generate(requests, params),
                BI: lambda: bi.generate(requests, params),
            }
            if has_hf:
                sides[HF] = _hf_generate(model, f"{tmp}/B{batch}", prompts_BT, new_tokens)
            seconds = dict(zip(sides, time_interleaved(list(sides.values()), timing, _modes(sides))))
            tokens = batch * new_tokens
            name = f"generate B={batch}"
            cases.append(_case(name, NATIVE, BI, seconds, tokens, TARGET_RATIO))
            progress(name)
            if has_hf:
                name = f"generate B={batch} vs HF transformers"
                case = _case(name, HF, BI, seconds, tokens, None)
                case.extra["builtin_native_tokens_per_s"] = tokens / seconds[NATIVE]
                cases.append(case)
                progress(name)
    cases.extend(decode_cases(options, progress))
    if options.quick:
        return cases
    real = models.build(real_width_config(), seed=0)
    native = BuiltinGenerator(real, BuiltinGeneratorConfig(batch_invariant=False, max_batch_size=REAL_WIDTH_BATCH))
    bi = BuiltinGenerator(real, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=REAL_WIDTH_BATCH))
    requests = _requests(torch.randint(0, real.config.vocab_size, (REAL_WIDTH_BATCH, prompt_len), generator=g))
    sides = {NATIVE: lambda: native.generate(requests, params), BI: lambda: bi.generate(requests, params)}
    seconds = dict(zip(sides, time_interleaved(list(sides.values()), timing, _modes(sides))))
    name = f"generate {REAL_WIDTH['preset']} widths L={REAL_WIDTH['num_hidden_layers']} B={REAL_WIDTH_BATCH}"
    cases.append(_case(name, NATIVE, BI, seconds, REAL_WIDTH_BATCH * new_tokens, TARGET_RATIO))
    progress(name)
    return cases


class _GatheredKeys:
    """A paged-cache batch whose steps give attention dense copies of the keys (`PagedKeys.gather()`
    per layer), so the model runs the dense attention on them: the decode cases' baseline."""

    def __init__(self, batch: object) -> None:
        self.batch = batch

    def begin(self, num_tokens: int) -> _GatheredStep:
        return _GatheredStep(self.batch.begin(num_tokens))


class _GatheredStep:
    def __init__(self, step: object) -> None:
        self.step = step
        self.q_pos_BT = step.q_pos_BT

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step.update(layer, k_BHTD, v_BHTD).gather()

    def commit(self) -> None:
        self.step.commit()


def decode_cases(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    """The `decode S=<S> B=<B>` cases (module doc): one prompt of S tokens prefilled (native ops:
    only the cache's presence matters here) and forked into B sequences, then BI decode steps
    timed with the dense gather and with the in-place read, interleaved."""
    lengths = QUICK_DECODE_LENGTHS if options.quick else DECODE_LENGTHS
    batch = QUICK_DECODE_BATCH if options.quick else DECODE_BATCH
    timing = BenchOptions(
        quick=options.quick, repeats=1 if options.quick else options.repeats, min_batch_s=options.min_batch_s
    )
    config = dataclasses.replace(get_preset("tiny-dense"), max_position_embeddings=max(lengths) + 1)
    model = models.build(config, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    cases: list[Case] = []
    for length in lengths:
        blocks = -(-(length + 1) // DECODE_BLOCK_SIZE)
        cache = PagedKVCache(config, batch * blocks, DECODE_BLOCK_SIZE)
        seqs = list(range(batch))
        cache.add(0)
        with torch.no_grad():
            model(torch.randint(0, config.vocab_size, (1, length), generator=g), cache=cache.batch([0]))
        for seq in seqs[1:]:
            cache.fork(0, seq)
        new_B1 = torch.randint(0, config.vocab_size, (batch, 1), generator=g)

        def step(view: object) -> torch.Tensor:
            with torch.no_grad():
                logits = model(new_B1, cache=view)
            for seq in seqs:
                cache.truncate(seq, length)  # the next step decodes at the same length
            return logits

        in_place, gathered = cache.batch(seqs), _GatheredKeys(cache.batch(seqs))
        with BI_MODE():
            same = torch.equal(step(in_place).view(torch.int32), step(gathered).view(torch.int32))
        sides = {GATHER: lambda: step(gathered), IN_PLACE: lambda: step(in_place)}
        seconds = dict(zip(sides, time_interleaved(list(sides.values()), timing, [BI_MODE, BI_MODE])))
        name = f"decode S={length} B={batch}"
        case = _case(name, GATHER, IN_PLACE, seconds, batch, None)
        case.extra.update(
            cached_tokens=length,
            decode_batch=batch,
            baseline_ms_per_token=1e3 * seconds[GATHER] / batch,
            candidate_ms_per_token=1e3 * seconds[IN_PLACE] / batch,
            logits_bitwise_equal=same,
        )
        cases.append(case)
        progress(name)
    return cases


def _case(
    name: str, baseline: str, candidate: str, seconds: dict[str, float], tokens: int, target: float | None
) -> Case:
    return Case(
        case=name,
        baseline=baseline,
        candidate=candidate,
        baseline_s=seconds[baseline],
        candidate_s=seconds[candidate],
        ratio=seconds[candidate] / seconds[baseline],
        target=target,
        extra={
            "new_tokens": tokens,
            "baseline_tokens_per_s": tokens / seconds[baseline],
            "candidate_tokens_per_s": tokens / seconds[candidate],
        },
    )


# ------------------------------------------------------------------------- --generator vllm
VLLM_TARGET_RATIO = 1.25  # our BI model inside vLLM: time <= this x vLLM's default mode, same weights
VLLM_BATCHES = [8, 32]
VLLM_DEFAULT = "vLLM default (its Qwen3 and sampler)"
VLLM_BI = "vLLM + titan model, BI mode (keyed sampler)"


def vllm_generate_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    """`bench generate --generator vllm`: two in-process vLLM engines on the same weights (tiny-dense,
    seed 0, exported once): baseline vLLM's default mode (its own Qwen3 implementation and CPU
    kernels, its own sampler at temperature 1, log-prob of each sampled token in its default
    `raw_logprobs` mode), candidate our model in BI mode inside vLLM (`VllmGenerator`: our
    attention backend, BI ops, keyed sampler, log-probs bitwise the trainer's). Same workload as
    the built-in cases (B prompts of 32 tokens, 32 new tokens each, no stop), timed interleaved;
    extra key `builtin_bi_tokens_per_s`: the built-in generator in BI mode on the same requests."""
    import vllm

    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig, keep_process_state, scoped_environment

    batches = QUICK_BATCHES if options.quick else VLLM_BATCHES
    prompt_len, new_tokens, timing, model, params = _workload(options)
    engine = dict(max_num_seqs=max(batches), max_num_batched_tokens=2048, kv_cache_memory_bytes=128 << 20)
    candidate = VllmGenerator(model, VllmGeneratorConfig(batch_invariant=True, **engine))
    builtin = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=max(batches)))
    try:
        with scoped_environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), keep_process_state():
            baseline = vllm.LLM(
                model=candidate._dir.name,
                skip_tokenizer_init=True,
                dtype="float32",
                enforce_eager=True,
                seed=0,
                max_model_len=model.config.max_position_embeddings,
                block_size=32,
                max_num_seqs=engine["max_num_seqs"],
                max_num_batched_tokens=engine["max_num_batched_tokens"],
                kv_cache_memory_bytes=engine["kv_cache_memory_bytes"],
                async_scheduling=False,
            )
        default_params = vllm.SamplingParams(
            temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, detokenize=False
        )
        g = torch.Generator().manual_seed(0)
        cases: list[Case] = []
        install_s = mode_install_seconds()
        for batch in batches:
            prompts_BT = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
            requests = _requests(prompts_BT)
            prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]

            def run_default(prompts=prompts) -> object:
                outputs = baseline.generate(prompts, default_params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
                baseline.reset_prefix_cache()  # as the candidate's sync does: no cross-call cache hits
                return outputs

            def run_bi(requests=requests) -> object:
                samples = candidate.generate(requests, params)
                candidate.llm.reset_prefix_cache()
                return samples

            sides = {
                VLLM_DEFAULT: run_default,
                VLLM_BI: run_bi,
                BI: lambda requests=requests: builtin.generate(requests, params),
            }
            seconds = dict(zip(sides, time_interleaved(list(sides.values()), timing, _modes(sides))))
            tokens = batch * new_tokens
            case = _case(f"generate B={batch} vLLM", VLLM_DEFAULT, VLLM_BI, seconds, tokens, VLLM_TARGET_RATIO)
            case.extra["builtin_bi_tokens_per_s"] = tokens / seconds[BI]
            case.extra["bi_mode_install_s"] = install_s
            cases.append(case)
            progress(case.case)
        return cases
    finally:
        candidate.close()
