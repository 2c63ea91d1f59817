"""Our attention backend over vLLM's paged KV cache: the trainer's attention bits inside vLLM.

vLLM hands a layer the new tokens of every scheduled request as one flat batch (`query`
[num_tokens, Hq, D], `key`/`value` [num_tokens, Hkv, D]) plus the metadata of the step
(`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`). `TitanAttentionImpl.forward`:
1. writes the new keys and values into the layer's paged cache at their slots (we own both the
   write and the read, so the layout inside a block is ours: the block
   `[kv_heads, block_size, 2 * D]` holds, per token, its key in the first D values and its value
   in the last D);
2. per request, gathers its keys and values in absolute position order from its blocks (whole
   blocks: the keys beyond seq_len are invisible to its queries), and runs `models.ops.attention`
   (in BI mode `batch_invariant.attention`) with the request's queries at their absolute positions
   seq_len - q_len .. seq_len - 1.
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
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            **unsupported,
        }
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
        plan = _plan(attn_metadata, query.device)
        if plan.decodes:
            self._decode(query, output, cache_BHNCD, plan)
        for start, q_len, r, seq_len in plan.prefills:
            self._prefill(query, output, cache_BHNCD, plan.block_table, start, q_len, r, seq_len)
        return output

    def _gather(self, cache_BHNCD: torch.Tensor, blocks_RB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of R requests whose blocks are the rows of blocks_RB, [R, Hkv,
        blocks * block_size, D] each, key j at absolute position j (beyond a request's own
        length: whatever its table's blocks hold there, invisible to its queries)."""
        rows, count = blocks_RB.shape
        kv = cache_BHNCD.index_select(0, blocks_RB.reshape(-1).long())  # [R * blocks, Hkv, block_size, 2, D]
        kv = kv.view(rows, count, self.num_kv_heads, -1, 2, self.head_size)
        shape = (rows, self.num_kv_heads, -1, self.head_size)
        k = kv[..., 0, :].permute(0, 2, 1, 3, 4).reshape(shape)
        v = kv[..., 1, :].permute(0, 2, 1, 3, 4).reshape(shape)
        return k, v

    def _prefill(self, query, output, cache_BHNCD, block_table, start: int, q_len: int, r: int, seq_len: int) -> None:
        block_size = cache_BHNCD.shape[2]
        k_1HSD, v_1HSD = self._gather(cache_BHNCD, block_table[r : r + 1, : -(-seq_len // block_size)])
        q_1HTD = query[start : start + q_len].transpose(0, 1)[None].contiguous()
        positions_1T = torch.arange(seq_len - q_len, seq_len, device=query.device)[None]
        out_1HTD = ops.attention(q_1HTD, k_1HSD, v_1HSD, positions_1T)
        output[start : start + q_len] = out_1HTD[0].transpose(0, 1)

    def _decode(self, query, output, cache_BHNCD, plan: _Plan) -> None:
        block_size = cache_BHNCD.shape[2]
        blocks_RB = plan.block_table.index_select(0, plan.decode_reqs)[:, : -(-plan.decode_longest // block_size)]
        k_BHSD, v_BHSD = self._gather(cache_BHNCD, blocks_RB)
        q_BH1D = query.index_select(0, plan.decode_rows)[:, :, None]
        out_BH1D = ops.attention(q_BH1D, k_BHSD, v_BHSD, plan.decode_positions)
        output.index_copy_(0, plan.decode_rows, out_BH1D[:, :, 0])


class _Plan:
    """Which requests of a step decode (one new token) and which prefill, from the step's
    metadata; computed once per step (the metadata object is shared by the layers)."""

    def __init__(self, metadata: CPUAttentionMetadata, device: torch.device) -> None:
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        num_reqs = len(seq_lens)
        assert len(starts) >= num_reqs + 1 and starts[num_reqs] == metadata.num_actual_tokens, (starts, seq_lens)
        self.block_table = metadata.block_table
        self.decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        self.prefills = [
            (starts[r], starts[r + 1] - starts[r], r, seq_lens[r])
            for r in range(num_reqs)
            if starts[r + 1] - starts[r] > 1
        ]
        if self.decodes:
            self.decode_reqs = torch.tensor(self.decodes, device=device)
            self.decode_rows = torch.tensor([starts[r] for r in self.decodes], device=device)
            self.decode_positions = torch.tensor([[seq_lens[r] - 1] for r in self.decodes], device=device)
            self.decode_longest = max(seq_lens[r] for r in self.decodes)


def _plan(metadata: CPUAttentionMetadata, device: torch.device) -> _Plan:
    plan = getattr(metadata, "_titan_plan", None)
    if plan is None:
        plan = _Plan(metadata, device)
        metadata._titan_plan = plan
    return plan


def _write(cache_BHNCD: torch.Tensor, key_NHD: torch.Tensor, value_NHD: torch.Tensor, slots_N: torch.Tensor) -> None:
    """Store token n's key and value at slot slots_N[n] (block slot // block_size, offset
    slot % block_size); negative slots (padding tokens) are skipped."""
    block_size = cache_BHNCD.shape[2]
    slots_N = slots_N.long()
    keep = slots_N >= 0
    if not bool(keep.all()):
        slots_N, key_NHD, value_NHD = slots_N[keep], key_NHD[keep], value_NHD[keep]
    blocks, offsets = slots_N // block_size, slots_N % block_size
    cache_BHNCD[blocks, :, offsets] = torch.stack((key_NHD, value_NHD), dim=2).to(cache_BHNCD.dtype)  # [N, H, 2, D]


class TitanAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with our implementation (`TitanAttentionImpl`); the KV
    cache update happens inside forward."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[TitanAttentionImpl]:
        return TitanAttentionImpl
