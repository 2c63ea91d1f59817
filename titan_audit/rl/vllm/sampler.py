"""Keyed sampling inside vLLM: a v1 logits processor that draws rl/sampling.py's token and makes
vLLM report our log-prob of it.

A request opts in with `SamplingParams(extra_args={"titan_audit": request_args(key, params)})`
(its SampleKey and our sampling params) and runs greedy in vLLM (temperature 0, `logprobs=0`)
on an engine started with `logits_processors=[KeyedSampler]` and
`logprobs_mode="processed_logits"`. For such a request's row of logits `z` (float32, from our
model's LM head) the processor computes, as the built-in generator does:

    scaled = scale_logits(z, T)                          # z / T, element-wise
    token  = sample_rows(scaled, [uniform(key, position)], params)   # position = tokens so far
    lp     = log_softmax(scaled)[token]                  # BI log_softmax in BI mode

and replaces the row by -inf everywhere except `token`, where it puts `lp`. vLLM's greedy
sampler then picks `token` (the only finite entry) and, in `processed_logits` mode, reports the
row's value at the sampled token, i.e. `lp`, bit for bit (float32 all the way). So the tokens are
the built-in generator's for the same keys and logits, and the reported log-prob is computed by
our ops, never by vLLM's sampler; vLLM's own seeded generators (which fail under chunked prefill
on CPU) are never used. Rows of requests without the extra arg are left untouched.

Position: `offset` (request_args; 0 for a fresh sample) + the number of output tokens the
request has so far (vLLM's live `output_tok_ids` list; async scheduling is off so it is exact).
With offset t and the sample's first t tokens appended to its prompt, a request continues the
sample exactly: the same uniforms, so (BI mode) the same tokens and log-probs. Rows of requests
whose prefill is not complete yet are processed too; vLLM discards their token.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from titan_audit import batch_invariant as bi
from titan_audit.models import ops
from titan_audit.rl.generator import SampleKey, SamplingParams
from titan_audit.rl.sampling import sample_rows, scale_logits, stream_key, uniform_from_stream
from titan_audit.rl.vllm.model import CONFIG_KEY, batch_invariant_requested


def request_args(key: SampleKey, params: SamplingParams, offset: int = 0) -> dict:
    """The `extra_args[CONFIG_KEY]` of one request (plain ints/floats: it crosses processes).
    `offset`: the decode position of the request's first new token (0 for a fresh sample; t to
    continue a sample whose first t tokens are appended to the prompt)."""
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"decode offset must be an int >= 0, got {offset!r}")
    return {
        "key": [key.seed, key.step, key.prompt_id, key.sample_index],
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "offset": offset,
    }


class _State:
    __slots__ = ("stream", "params", "output", "offset")

    def __init__(self, stream: bytes, params: SamplingParams, output: list[int], offset: int) -> None:
        self.stream, self.params, self.output, self.offset = stream, params, output, offset

    @property
    def position(self) -> int:
        return self.offset + len(self.output)


class KeyedSampler(LogitsProcessor):
    """See the module doc."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.batch_invariant = batch_invariant_requested(vllm_config)
        self.states: dict[int, _State] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        args = (sampling_params.extra_args or {}).get(CONFIG_KEY)
        if args is None:
            return
        if sampling_params.temperature != 0.0 or sampling_params.logprobs != 0:
            raise ValueError("a titan-audit keyed request must be greedy in vLLM (temperature 0) with logprobs=0")
        SampleKey(*args["key"])

    def is_argmax_invariant(self) -> bool:
        return False  # it chooses the token: it must run for greedy requests

    @staticmethod
    def _new_state(params, prompt_ids, output_ids) -> _State | None:
        args = (params.extra_args or {}).get(CONFIG_KEY)
        if args is None:
            return None
        ours = SamplingParams(
            temperature=args["temperature"], top_p=args["top_p"], top_k=args["top_k"], max_new_tokens=1
        )  # unused by the draw
        return _State(stream_key(SampleKey(*args["key"])), ours, output_ids, int(args.get("offset", 0)))

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.states, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        mode = bi.enabled() if self.batch_invariant and not bi.is_enabled() else contextlib.nullcontext()
        groups: dict[SamplingParams, list[int]] = {}
        for i in sorted(self.states):
            if i < logits.shape[0]:
                groups.setdefault(self.states[i].params, []).append(i)
        with mode:
            for params, rows in groups.items():  # rows are independent: grouping changes no bits
                # every row of the batch (rows are sorted and distinct): no gather, no scatter back
                whole = len(rows) == logits.shape[0]
                index = None if whole else torch.tensor(rows, device=logits.device)
                scaled_BV = scale_logits(logits if whole else logits.index_select(0, index), params.temperature)
                uniforms = [uniform_from_stream(self.states[i].stream, self.states[i].position) for i in rows]
                tokens_B1 = sample_rows(scaled_BV, uniforms, params)[:, None]
                logprobs_B1 = ops.log_softmax(scaled_BV, -1).gather(1, tokens_B1).to(logits.dtype)
                if whole:
                    logits.fill_(float("-inf")).scatter_(1, tokens_B1, logprobs_B1)
                else:
                    logits.index_fill_(0, index, float("-inf"))
                    logits[index, tokens_B1[:, 0]] = logprobs_B1[:, 0]
        return logits
