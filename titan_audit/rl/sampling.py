"""Keyed sampling: one uniform per (sample key, decode position), and a batch-independent draw.

Guarantees:
- `sample_uniform(key, position)` is a pure function of the `SampleKey` (seed, step, prompt_id,
  sample_index) and the decode position (the index of the new token in the completion, 0 for
  the first). It never depends on a batch, an arrival order, a rank or a process. Derivation
  (stable across versions, platforms and processes; counter-mode keyed hash):
      stream key = BLAKE2b("<QqQQ" seed | step | prompt_id | sample_index,
                           digest_size=16, person=b"titan-audit/smp1")
      word       = BLAKE2b("<Q" position, digest_size=8, key=stream key)   (little-endian u64)
      uniform    = (word >> 11) * 2**-53                                    (in [0, 1), 53 bits)
- `sample_rows(scaled_V, uniforms, params)` draws one token per row. Each row's token is a
  function of that row's values and its uniform alone, computed in a fixed order that does not
  depend on the other rows: in batch-invariant mode the probabilities come from the BI softmax
  (row-invariant bits); the order is a stable descending sort (ties broken by the lower token
  id, an exact permutation); the cumulative sums are float64 sequential scans along each row
  (torch's CPU cumsum); the selection is exact comparisons (searchsorted). So a sample's tokens
  are bitwise the same alone, in any batch and in any arrival order whenever its logits are.
  (On CPU. Other devices run the same steps there, with that device's cumsum.)

The draw (inverse CDF over the kept tokens, in sorted order when truncating):
- top-k (k > 0) keeps the k tokens with the largest temperature-scaled logits (ties: lower id);
- then top-p (p < 1) keeps the smallest prefix of that order whose mass, renormalised over the
  top-k tokens, reaches p (the token that crosses p is kept; at least one token is always kept)
  -- the order HF transformers and vLLM apply them in;
- the token is the first kept one whose cumulative probability exceeds u * (kept mass), never a
  token of zero probability.
With neither truncation the draw runs over the vocabulary in token-id order (no sort needed).
The reported log-prob is not computed here: it is log_softmax(logits / temperature) over the
full vocabulary (`rl/logprobs.py`, generator.py's docstring); truncation never changes it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from titan_audit.models import ops
from titan_audit.rl.generator import SampleKey, SamplingParams

_PERSON = b"titan-audit/smp1"
_U64 = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def check_key(key: SampleKey) -> None:
    """ValueError naming the field of `key` that does not fit the stream derivation."""
    if not isinstance(key, SampleKey):
        raise ValueError(f"a sample key must be a SampleKey, got {type(key).__name__}")
    for name in ("seed", "prompt_id", "sample_index"):
        value = getattr(key, name)
        if not isinstance(value, int) or not 0 <= value <= _U64:
            raise ValueError(f"sample key {name} must be an int in [0, 2**64), got {value!r} in {key}")
    if not isinstance(key.step, int) or not _I64_MIN <= key.step <= _I64_MAX:
        raise ValueError(f"sample key step must be an int64, got {key.step!r} in {key}")


def stream_key(key: SampleKey) -> bytes:
    """The 16-byte key of the sample's stream (see the module doc)."""
    check_key(key)
    message = struct.pack("<QqQQ", key.seed, key.step, key.prompt_id, key.sample_index)
    return hashlib.blake2b(message, digest_size=16, person=_PERSON).digest()


def uniform_from_stream(stream: bytes, position: int) -> float:
    """The uniform in [0, 1) at decode `position` of the stream keyed `stream`."""
    if not 0 <= position <= _U64:
        raise ValueError(f"decode position must be in [0, 2**64), got {position}")
    word = hashlib.blake2b(struct.pack("<Q", position), digest_size=8, key=stream).digest()
    return (int.from_bytes(word, "little") >> 11) * (1.0 / (1 << 53))


def sample_uniform(key: SampleKey, position: int) -> float:
    """The uniform in [0, 1) that draws the token at decode `position` of sample `key`."""
    return uniform_from_stream(stream_key(key), position)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits (any float dtype) -> float32 logits / temperature: an element-wise IEEE division,
    so the same bits for a row wherever it sits. The generator and the trainer both use it."""
    return logits.float() / float(temperature)


def _first_greater(cum_BV: torch.Tensor, value_B1: torch.Tensor, right: bool) -> torch.Tensor:
    """Per row: the first index whose cum is > value (right) or >= value (left), [B]."""
    return torch.searchsorted(cum_BV, value_B1, right=right).squeeze(1)


def sample_rows(scaled_BV: torch.Tensor, uniforms: Sequence[float], params: SamplingParams) -> torch.Tensor:
    """One token id per row of temperature-scaled logits `scaled_BV` (float32 [B, V]), row b
    drawn with `uniforms[b]`; int64 [B]. See the module doc for the rule and its invariance."""
    batch, vocab = scaled_BV.shape
    assert len(uniforms) == batch, (len(uniforms), batch)
    truncate = (0 < params.top_k < vocab) or params.top_p < 1.0
    if truncate:
        ordered_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True, stable=True)
    else:
        ordered_BV, order_BV = scaled_BV, None
    cum_BV = torch.cumsum(ops.softmax(ordered_BV, -1).double(), dim=-1)  # sequential per row
    device = scaled_BV.device
    if truncate:
        keep_B = torch.full((batch,), vocab, dtype=torch.long, device=device)
        if 0 < params.top_k < vocab:
            keep_B = torch.full((batch,), params.top_k, dtype=torch.long, device=device)
        if params.top_p < 1.0:
            mass_k_B1 = cum_BV.gather(1, (keep_B - 1)[:, None])
            # first rank whose renormalised cumulative mass reaches p; it is kept too
            crossing_B = _first_greater(cum_BV, mass_k_B1 * params.top_p, right=False)
            keep_B = torch.minimum(keep_B, crossing_B + 1)
        keep_B = keep_B.clamp(1, vocab)
        kept_mass_B1 = cum_BV.gather(1, (keep_B - 1)[:, None])
    else:  # every token kept: the kept mass is the last cumulative sum (the same value, no gather)
        kept_mass_B1 = cum_BV[:, -1:].contiguous()  # searchsorted warns about a strided value tensor
    u_B1 = torch.tensor(list(uniforms), dtype=torch.float64, device=device)[:, None]
    rank_B = _first_greater(cum_BV, u_B1 * kept_mass_B1, right=True)
    last_positive_B = _first_greater(cum_BV, kept_mass_B1, right=False)  # last token adding mass
    rank_B = torch.minimum(rank_B, last_positive_B).clamp(0, vocab - 1)
    if order_BV is None:
        return rank_B
    return order_BV.gather(1, rank_B[:, None]).squeeze(1)
