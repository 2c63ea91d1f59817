"""Our attention backend over vLLM's paged KV cache: the trainer's attention bits inside vLLM.

vLLM hands a layer the new tokens of every scheduled request as one flat batch (`query`
[num_tokens, Hq, D], `key`/`value` [num_tokens, Hkv, D]) plus the metadata of the step
(`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`). `TitanAttentionImpl.forward`:
1. writes the new keys and values into the layer's paged cache at their slots (we own both the
   write and the read, so the layout inside a block is ours: the block
   `[kv_heads, block_size, 2 * D]` holds, per token, its key in the first D values and its value
   in the last D);
2. per request, gathers its keys and values 0 .. seq_len - 1 in absolute position order from its
   blocks, and runs `models.ops.attention` (in BI mode `batch_invariant.attention`) with the
   request's queries at their absolute positions seq_len - q_len .. seq_len - 1.
So a query row sees exactly the keys a full forward of its sequence gives it, at the same key
indices, and `batch_invariant.attention` reduces over keys in fixed chunks aligned to absolute
key positions: a token's attention output is bitwise the same from a whole-prompt prefill, a
chunked prefill, a prefix-cache hit (its keys were written by an earlier request with the same
bits) or a decode step, alone or with any other requests, and equal to the trainer's full
forward (guarantee G4). Decode requests (one new token) run together in one call, their keys
right-padded to the longest: padding keys lie beyond each query's position, so they are
invisible and (BI attention contract) do not change its bits. Other requests run one per call.

The metadata builder and cache shape are vLLM's CPU ones (`CPUAttentionBackend`); only the
implementation differs. The backend is selected per layer by `model.py`
(`Attention(..., attn_backend=TitanAttentionBackend)`), so no global registration is needed in
any process.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata

from titan_audit.models import ops


class TitanAttentionImpl(AttentionImpl):
    """Decoder self-attention through `models.ops.attention` (see the module doc)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unsupported: object,
    ) -> None:
        what = {
            "alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap, "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            **unsupported,
        }  # fmt: skip
        bad = sorted(k for k, v in what.items() if v is not None)
        if bad or attn_type != AttentionType.DECODER or kv_cache_dtype != "auto":
            raise ValueError(
                f"titan-audit attention: only plain causal decoder attention with an unquantized KV cache is "
                f"supported (got attn_type={attn_type!r}, kv_cache_dtype={kv_cache_dtype!r}, set: {bad})"
            )
        assert scale == head_size**-0.5, (scale, head_size)  # what models/ uses
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sliding_window = -1
        self.sinks = None

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output_scale is None and output_block_scale is None, "fused output quantization"
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        num_tokens = attn_metadata.num_actual_tokens
        num_blocks, kv_heads, block_size, width = kv_cache.shape
        dim = self.head_size
        assert kv_heads == self.num_kv_heads and width == 2 * dim, (kv_cache.shape, kv_heads, dim)
        cache_BHNCD = kv_cache.view(num_blocks, kv_heads, block_size, 2, dim)
        _write(cache_BHNCD, key[:num_tokens], value[:num_tokens], attn_metadata.slot_mapping[:num_tokens])

        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        num_reqs = len(seq_lens)
        assert len(starts) >= num_reqs + 1 and starts[num_reqs] == num_tokens, (starts, seq_lens, num_tokens)
        block_table = attn_metadata.block_table
        decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        if decodes:
            self._decode(query, output, cache_BHNCD, block_table, starts, seq_lens, decodes)
        for r in range(num_reqs):
            q_len = starts[r + 1] - starts[r]
            if q_len > 1:
                self._run(query, output, cache_BHNCD, block_table, starts[r], q_len, r, seq_lens[r])
        return output

    def _keys(self, cache_BHNCD: torch.Tensor, block_table: torch.Tensor, r: int, length: int,
              padded: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Request r's keys and values 0 .. padded - 1, [Hkv, padded, D] each (beyond `length`:
        whatever its blocks hold there; invisible to its queries)."""
        block_size = cache_BHNCD.shape[2]
        blocks = block_table[r, : -(-padded // block_size)].long()
        kv_bHNCD = cache_BHNCD.index_select(0, blocks)  # [blocks, Hkv, block_size, 2, D]
        kv_HSCD = kv_bHNCD.transpose(0, 1).reshape(self.num_kv_heads, -1, 2, self.head_size)[:, :padded]
        assert length <= kv_HSCD.shape[1], (length, kv_HSCD.shape)
        return kv_HSCD[:, :, 0], kv_HSCD[:, :, 1]

    def _run(self, query, output, cache_BHNCD, block_table, start: int, q_len: int, r: int, seq_len: int) -> None:
        k_HSD, v_HSD = self._keys(cache_BHNCD, block_table, r, seq_len, seq_len)
        q_1HTD = query[start : start + q_len].transpose(0, 1)[None]
        positions_1T = torch.arange(seq_len - q_len, seq_len, device=query.device)[None]
        out_1HTD = ops.attention(q_1HTD.contiguous(), k_HSD[None].contiguous(), v_HSD[None].contiguous(), positions_1T)
        output[start : start + q_len] = out_1HTD[0].transpose(0, 1)

    def _decode(self, query, output, cache_BHNCD, block_table, starts, seq_lens, decodes: list[int]) -> None:
        longest = max(seq_lens[r] for r in decodes)
        keys, values = zip(*(self._keys(cache_BHNCD, block_table, r, seq_lens[r], longest) for r in decodes))
        rows = torch.tensor([starts[r] for r in decodes], device=query.device)
        q_B1HD = query.index_select(0, rows)[:, None]  # [B, 1, Hq, D]
        positions_B1 = torch.tensor([[seq_lens[r] - 1] for r in decodes], device=query.device)
        out_BH1D = ops.attention(
            q_B1HD.transpose(1, 2).contiguous(), torch.stack(keys), torch.stack(values), positions_B1
        )
        output.index_copy_(0, rows, out_BH1D[:, :, 0])


def _write(cache_BHNCD: torch.Tensor, key_NHD: torch.Tensor, value_NHD: torch.Tensor, slots_N: torch.Tensor) -> None:
    """Store token n's key and value at slot slots_N[n] (block slot // block_size, offset
    slot % block_size); negative slots (padding tokens) are skipped."""
    block_size = cache_BHNCD.shape[2]
    slots_N = slots_N.long()
    keep = slots_N >= 0
    if not bool(keep.all()):
        slots_N, key_NHD, value_NHD = slots_N[keep], key_NHD[keep], value_NHD[keep]
    blocks, offsets = slots_N // block_size, slots_N % block_size
    cache_BHNCD[blocks, :, offsets, 0] = key_NHD.to(cache_BHNCD.dtype)
    cache_BHNCD[blocks, :, offsets, 1] = value_NHD.to(cache_BHNCD.dtype)


class TitanAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with our implementation (`TitanAttentionImpl`); the KV
    cache update happens inside forward."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[TitanAttentionImpl]:
        return TitanAttentionImpl
