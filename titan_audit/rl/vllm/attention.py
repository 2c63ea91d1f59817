"""Our attention backend over vLLM's paged KV cache: the trainer's attention bits inside vLLM.

vLLM hands a layer the new tokens of every scheduled request as one flat batch (`query`
[num_tokens, Hq, D], `key`/`value` [num_tokens, Hkv, D]) plus the metadata of the step
(`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`). `TitanAttentionImpl.attend`
(what `model.py` calls per layer; `forward`, vLLM's `Attention`-layer entry, wraps it):
1. writes the new keys and values into the layer's paged cache at their slots (we own both the
   write and the read, so the layout inside a block is ours: the block `[block_size, kv_heads,
   2, D]` holds, per token and kv head, its key then its value; one `index_copy_` per layer,
   the token's slot being its row in the cache viewed as [num_blocks * block_size, ...]);
2. per request, attends over its keys and values in absolute position order (key j at block
   block_table[j // block_size], slot j % block_size; keys beyond seq_len are invisible to its
   queries), its queries at their absolute positions seq_len - q_len .. seq_len - 1. In BI mode
   the backend's paged kernel (`paged_attention`: ours on CPU, Triton's on CUDA) reads them in
   place through vLLM's block table, no copy: it is the dense kernel with only the addresses
   changed, so its bits are those of `batch_invariant.attention` (what `models.ops.attention`
   runs in BI mode) over the gathered keys. Natively (or where autograd records) whole blocks
   are gathered (one `index_select` for keys and values together) as strided [R, Hkv, S, D]
   views and `models.ops.attention` runs on them.
So a query row sees exactly the keys a full forward of its sequence gives it, at the same key
indices, and the BI kernel reduces over keys in fixed chunks aligned to absolute key positions:
a token's attention output is bitwise the same from a whole-prompt prefill, a chunked prefill, a
prefix-cache hit (its keys were written by an earlier request with the same bits) or a decode
step, alone or with any other requests, and equal to the trainer's full forward (guarantee G4).
Decode requests (one new token) run together in one call, their block tables cut to the
longest: keys past a request's seq_len lie beyond its query's position, so they are invisible
and (BI attention contract) do not change its bits. Prefilling requests run in runs: consecutive
requests with the same query and sequence lengths (a batch of fresh prompts of one length) are
one call, their queries a view of consecutive rows; a row's bits do not depend on the other rows
of its call.
In a step where every request decodes, the queries are read in place and the call's output is
the layer's output (no copy in or out).

What the layers of a step share (slots to write, decode/prefill split, block rows, query
positions) is computed once per step (`_Plan`, kept on the step's metadata object). The
metadata and cache shape are vLLM's CPU ones (`CPUAttentionBackend`); the builder
(`TitanAttentionMetadataBuilder`) only skips the scheduler metadata of vLLM's own CPU kernel,
which never runs here. The backend is selected per layer by `model.py`
(`Attention(..., attn_backend=TitanAttentionBackend)`), so no global registration is needed in
any process.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from titan_audit import batch_invariant as bi
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
        """vLLM's interface (through its `Attention` layer): `attend` into vLLM's `output`."""
        assert output_scale is None and output_block_scale is None, "fused output quantization"
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        out_NF = self.attend(query, key, value, kv_cache, attn_metadata)
        output.view(out_NF.shape[0], -1)[: out_NF.shape[0]] = out_NF
        return output

    def attend(
        self,
        query_NHD: torch.Tensor,
        key_NHD: torch.Tensor,
        value_NHD: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CPUAttentionMetadata,
    ) -> torch.Tensor:
        """Write the step's keys/values into the cache, then the attention output [num_tokens,
        Hq * D] of every scheduled token (rows in the step's token order). query/key/value:
        [>= num_tokens, H, D], any strides with a contiguous last dim."""
        num_blocks, kv_heads, block_size, width = kv_cache.shape
        dim = self.head_size
        assert kv_heads == self.num_kv_heads and width == 2 * dim, (kv_cache.shape, kv_heads, dim)
        cache_BNHCD = kv_cache.view(num_blocks, block_size, kv_heads, 2, dim)  # our layout inside a block
        plan = _plan(metadata, block_size)
        n = plan.num_tokens
        kv_NHCD = torch.stack((key_NHD[:n], value_NHD[:n]), dim=2)
        if plan.write_rows is not None:
            kv_NHCD = kv_NHCD.index_select(0, plan.write_rows)
        cache_BNHCD.view(-1, self.num_kv_heads, 2, dim).index_copy_(0, plan.slots, kv_NHCD)
        if plan.all_decode:  # the common step: every request decodes, its token at row r
            q_BH1D = query_NHD[:n, :, None]
            out_BH1D = self._attend(cache_BNHCD, q_BH1D, plan.decode_blocks, plan.decode_lens, plan.decode_positions)
            return out_BH1D.view(n, -1)
        out_NHD = query_NHD.new_empty((n, self.num_heads, dim))
        if plan.decodes:
            q_BH1D = query_NHD.index_select(0, plan.decode_rows)[:, :, None]
            out_BH1D = self._attend(cache_BNHCD, q_BH1D, plan.decode_blocks, plan.decode_lens, plan.decode_positions)
            out_NHD.index_copy_(0, plan.decode_rows, out_BH1D[:, :, 0])
        for start, q_len, count, blocks_RB, positions_RT, seq_lens_R in plan.prefills:
            rows = slice(start, start + count * q_len)  # the run's queries: consecutive rows, q_len each
            q_RHTD = query_NHD[rows].view(count, q_len, self.num_heads, dim).transpose(1, 2)
            out_RHTD = self._attend(cache_BNHCD, q_RHTD, blocks_RB, seq_lens_R, positions_RT)
            out_NHD[rows] = out_RHTD.transpose(1, 2).reshape(count * q_len, self.num_heads, dim)
        return out_NHD.view(n, -1)

    def _attend(
        self,
        cache_BNHCD: torch.Tensor,
        q_RHTD: torch.Tensor,
        blocks_RB: torch.Tensor,
        seq_lens_R: torch.Tensor,
        positions_RT: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of R requests' queries over their keys, the blocks of blocks_RB (long), key j
        at block blocks_RB[r, j // block_size]: in BI mode outside autograd the backend's paged
        kernel reads them in place (the bits of the dense kernel over the gathered keys); otherwise
        `_gather` then `_attention`."""
        if bi.is_enabled() and not (torch.is_grad_enabled() and q_RHTD.requires_grad):
            k_NHSD = cache_BNHCD[:, :, :, 0].transpose(1, 2)  # [blocks, Hkv, block_size, D] views
            v_NHSD = cache_BNHCD[:, :, :, 1].transpose(1, 2)
            out, _ = bi.backend_for(q_RHTD).paged_attention(
                q_RHTD,
                k_NHSD,
                v_NHSD,
                blocks_RB,
                seq_lens_R,
                positions_RT,
                self.scale,
                causal=True,
                max_seq_len=blocks_RB.shape[1] * cache_BNHCD.shape[1],
            )
            return out
        k_RHSD, v_RHSD = self._gather(cache_BNHCD, blocks_RB)
        return _attention(q_RHTD, k_RHSD, v_RHSD, positions_RT)

    def _gather(self, cache_BNHCD: torch.Tensor, blocks_RB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of R requests whose blocks are the rows of blocks_RB (long), [R, Hkv,
        blocks * block_size, D] each (strided views of one copy of the blocks), key j at absolute
        position j (beyond a request's own length: whatever its table's blocks hold there,
        invisible to its queries)."""
        rows, count = blocks_RB.shape
        kv = cache_BNHCD.index_select(0, blocks_RB.reshape(-1))  # [R * blocks, block_size, Hkv, 2, D]
        kv_RSHCD = kv.view(rows, count * cache_BNHCD.shape[1], self.num_kv_heads, 2, self.head_size)
        return kv_RSHCD[:, :, :, 0].transpose(1, 2), kv_RSHCD[:, :, :, 1].transpose(1, 2)


def _attention(q_BHTD, k_BHSD, v_BHSD, positions_BT) -> torch.Tensor:
    """`models.ops.attention` without key documents (where the paged kernel does not run, see
    `TitanAttentionImpl._attend`): in BI mode the kernel call it makes
    (`batch_invariant.attention`'s, causal, at the given query positions), without its torch.compile
    barrier (vLLM runs this model eagerly) and, outside autograd, without its argument checks (what
    they check holds by construction here: `_Plan` builds the long [R, T] positions, `_gather`
    the [R, Hkv, S, D] keys and values); the same kernel, so the same bits."""
    if not bi.is_enabled():
        return ops.attention(q_BHTD, k_BHSD, v_BHSD, positions_BT)
    if torch.is_grad_enabled() and q_BHTD.requires_grad:
        return bi.attention(q_BHTD, k_BHSD, v_BHSD, causal=True, q_positions=positions_BT)
    scale = q_BHTD.shape[-1] ** -0.5
    out, _ = bi.backend_for(q_BHTD).attention_forward(q_BHTD, k_BHSD, v_BHSD, scale, True, positions_BT, None)
    return out


class _Plan:
    """What every layer of a step shares, from the step's metadata, computed once per step (the
    metadata object is shared by the layers): the cache slots to write, which requests decode
    (one new token) and which prefill, their blocks and query positions."""

    def __init__(self, metadata: CPUAttentionMetadata, block_size: int) -> None:
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        num_reqs = len(seq_lens)
        n = metadata.num_actual_tokens
        assert len(starts) >= num_reqs + 1 and starts[num_reqs] == n, (starts, seq_lens)
        device = metadata.query_start_loc.device
        self.block_size = block_size
        self.num_tokens = n
        slots = metadata.slot_mapping[:n].long()
        keep = slots >= 0  # negative slots (padding tokens) are not written
        self.write_rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        self.slots = slots if self.write_rows is None else slots.index_select(0, self.write_rows)
        table = metadata.block_table.long()
        q_lens = [starts[r + 1] - starts[r] for r in range(num_reqs)]
        self.decodes = [r for r in range(num_reqs) if q_lens[r] == 1]
        self.all_decode = len(self.decodes) == num_reqs == n
        # prefills: runs of consecutive requests with the same query and sequence lengths (a batch
        # of fresh prompts of one length is one run), each run one attention call
        self.prefills = []
        r = 0
        while r < num_reqs:
            end = r + 1
            if q_lens[r] > 1:
                while end < num_reqs and (q_lens[end], seq_lens[end]) == (q_lens[r], seq_lens[r]):
                    end += 1
                blocks = table[r:end, : -(-seq_lens[r] // block_size)]
                positions_RT = torch.arange(seq_lens[r] - q_lens[r], seq_lens[r], device=device).expand(end - r, -1)
                lens_R = torch.full((end - r,), seq_lens[r], dtype=torch.long, device=device)
                self.prefills.append((starts[r], q_lens[r], end - r, blocks, positions_RT, lens_R))
            r = end
        if self.decodes:
            longest = max(seq_lens[r] for r in self.decodes)
            reqs = torch.tensor(self.decodes, device=device)
            self.decode_blocks = table.index_select(0, reqs)[:, : -(-longest // block_size)]
            self.decode_rows = torch.tensor([starts[r] for r in self.decodes], device=device)
            self.decode_positions = torch.tensor([[seq_lens[r] - 1] for r in self.decodes], device=device)
            self.decode_lens = torch.tensor([seq_lens[r] for r in self.decodes], device=device)


def _plan(metadata: CPUAttentionMetadata, block_size: int) -> _Plan:
    plan = getattr(metadata, "_titan_plan", None)
    if plan is None:
        plan = _Plan(metadata, block_size)
        metadata._titan_plan = plan
    assert plan.block_size == block_size, (plan.block_size, block_size)
    return plan


class TitanAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata (the same fields) without the scheduler metadata of vLLM's own CPU
    kernel (we do not run it)."""

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> CPUAttentionMetadata:
        common = common_attn_metadata
        assert not isinstance(common.causal, torch.Tensor) and common.causal, "causal decoder attention only"
        metadata = CPUAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            max_seq_len=common.max_seq_len,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
            scheduler_metadata=None,
            causal=True,
        )
        return metadata


class TitanAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with our implementation (`TitanAttentionImpl`) and metadata
    builder (`TitanAttentionMetadataBuilder`); the KV cache update happens inside forward."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls() -> type[TitanAttentionImpl]:
        return TitanAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TitanAttentionMetadataBuilder]:
        return TitanAttentionMetadataBuilder
