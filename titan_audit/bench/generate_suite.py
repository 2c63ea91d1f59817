"""`bench generate`: tokens/s of the built-in generator in BI mode against the same generator on
native ops, and against a plain HF-transformers `generate` of the same model.

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
Extra keys: `baseline_tokens_per_s`, `candidate_tokens_per_s` (new tokens per second of each side),
`new_tokens` (per call), and on the HF case `builtin_native_tokens_per_s`.
The three sides of one B are timed interleaved (bench/core.py), so noise hits them alike.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable

import torch

from titan_audit import models
from titan_audit.bench.core import BenchOptions, Case, time_interleaved
from titan_audit.rl.builtin import BuiltinGenerator, BuiltinGeneratorConfig
from titan_audit.rl.generator import GenerationRequest, SampleKey, SamplingParams

TARGET_RATIO = 1.25
BATCHES = [8, 32, 64]
PROMPT_LEN, NEW_TOKENS = 32, 32
QUICK_BATCHES = [8]
QUICK_PROMPT_LEN, QUICK_NEW_TOKENS = 8, 4
NATIVE, BI, HF = "builtin generator, native ops", "builtin generator, BI mode", "HF transformers generate"


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
                input_ids=prompts_BT, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=0, eos_token_id=None, use_cache=True,
            )  # fmt: skip

    return run


def generate_suite(options: BenchOptions, progress: Callable[[str], None]) -> list[Case]:
    batches = QUICK_BATCHES if options.quick else BATCHES
    prompt_len = QUICK_PROMPT_LEN if options.quick else PROMPT_LEN
    new_tokens = QUICK_NEW_TOKENS if options.quick else NEW_TOKENS
    repeats = 1 if options.quick else options.repeats
    timing = BenchOptions(quick=options.quick, repeats=repeats, min_batch_s=options.min_batch_s)
    model = models.build("tiny-dense", seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    native = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=False, max_batch_size=max(batches)))
    bi = BuiltinGenerator(model, BuiltinGeneratorConfig(batch_invariant=True, max_batch_size=max(batches)))
    has_hf = importlib.util.find_spec("transformers") is not None
    g = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="titan-audit-bench-generate-") as tmp:
        for batch in batches:
            prompts_BT = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g)
            requests = [
                GenerationRequest(tuple(row), SampleKey(0, 0, i, 0)) for i, row in enumerate(prompts_BT.tolist())
            ]
            sides = {
                NATIVE: lambda: native.generate(requests, params),
                BI: lambda: bi.generate(requests, params),
            }
            if has_hf:
                sides[HF] = _hf_generate(model, f"{tmp}/B{batch}", prompts_BT, new_tokens)
            seconds = dict(zip(sides, time_interleaved(list(sides.values()), timing)))
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
    return cases


def _case(
    name: str, baseline: str, candidate: str, seconds: dict[str, float], tokens: int, target: float | None
) -> Case:
    return Case(
        case=name, baseline=baseline, candidate=candidate,
        baseline_s=seconds[baseline], candidate_s=seconds[candidate],
        ratio=seconds[candidate] / seconds[baseline], target=target,
        extra={"new_tokens": tokens, "baseline_tokens_per_s": tokens / seconds[baseline],
               "candidate_tokens_per_s": tokens / seconds[candidate]},
    )  # fmt: skip
