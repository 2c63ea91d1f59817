"""`TitanForCausalLM`: the models/ transformer as an out-of-tree vLLM architecture.

vLLM builds it from a checkpoint directory written by `models.save_pretrained` (HF layout,
`config.json` read by `models.hf_config`, so Qwen3 / Qwen3-MoE / Llama checkpoints of models/
load unchanged) when the engine is started with `hf_overrides={"architectures": [ARCHITECTURE]}`.

What runs: a `models.Transformer` built from that config holds every weight, and the forward below
calls its modules and the same `models.ops` functions in the same order as `Transformer.forward` /
`Block.forward` / `models.attention.Attention.forward`: embedding, RMSNorms, q/k/v projections,
q/k-norm, RoPE from the model's own table, o-projection, SwiGLU MLP or MoE, final norm, LM head.
vLLM's flat `[num_tokens]` batch (every scheduled token of every request) is one `[num_tokens, D]`
row block: every op but attention acts on one token's row, and in batch-invariant mode a row's
bits do not depend on the other rows. Three regroupings keep every bit
(tests/rl/test_vllm_parity.py proves it against the trainer): q/k/v are one gemm over the
row-stacked weights [q; k; v], gate/up one gemm over [gate; up] (an output column of the BI gemm
is one fixed-order sum over K of its own weight row, whatever the other columns), q- and k-norm
one RMSNorm call over the heads of both (a row per head) and RoPE one call over q's and k's heads
(element-wise). Fusions keep every bit as well (`models.ops.add_rms_norm` / `rms_norm_rope` /
`silu_mul`, forward-only kernels, bitwise their compositions for every non-NaN value): each
residual add with the norm after it (the block's post-attention norm; the next block's input norm,
or the final norm), q/k-norm with RoPE, and SwiGLU's silu(gate) * up. The stacked weights are the
storage: each q/k/v/gate/up parameter is a view of its row block, so `load_weights` and the
in-place weight sync write them and the packed-weight cache sees the writes (a view bumps its
base's version counter). Attention calls our backend (`attention.py`) through the vLLM `Attention`
layer of each block (so vLLM allocates and schedules the paged KV cache), reading that layer's
cache and the step's metadata from vLLM's forward context. Hence in BI mode a token's logits are
bitwise those of the trainer's full forward of its sequence (guarantee G4).

Modes: `additional_config={"titan_audit": {"batch_invariant": true}}` (what VllmGenerator
passes) runs forward and logits inside `batch_invariant.enabled()`; otherwise the model runs in
whatever mode the process is in (native ops by default: the same math, no bitwise promise).
Only float32 is supported (the RL loop's dtype).

Weights: `load_weights` takes HF names (experts per expert, stacked here); `titan_state_dict()`
gives the models/ state dict (the names `Transformer.state_dict()` uses), which the generator's
in-place weight sync copies into and fingerprints.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from titan_audit import batch_invariant as bi
from titan_audit.models import ops
from titan_audit.models.hf_config import config_from_hf
from titan_audit.models.mlp import FeedForward
from titan_audit.models.rope import apply_rope
from titan_audit.models.transformer import Transformer

ARCHITECTURE = "TitanAuditForCausalLM"
CONFIG_KEY = "titan_audit"
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fuse(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """One [sum of rows, K] matrix holding the weights of module.<name> (nn.Linear, no bias) as
    row blocks in `names` order; each weight parameter is replaced by a view of its block."""
    weights = [getattr(module, name).weight for name in names]
    fused = torch.empty(
        (sum(w.shape[0] for w in weights), weights[0].shape[1]), dtype=weights[0].dtype, device=weights[0].device
    )
    row = 0
    for name, weight in zip(names, weights):
        block = fused[row : row + weight.shape[0]]
        block.copy_(weight)
        getattr(module, name).weight = nn.Parameter(block, requires_grad=False)
        row += weight.shape[0]
    return fused


def batch_invariant_requested(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return bool((extra.get(CONFIG_KEY) or {}).get("batch_invariant", False))


class TitanForCausalLM(nn.Module):
    """The vLLM model interface over `models.Transformer` (see the module doc)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from titan_audit.rl.vllm.attention import TitanAttentionBackend

        hf_config = vllm_config.model_config.hf_config
        config = config_from_hf(hf_config.to_dict(), f"{vllm_config.model_config.model}/config.json")
        dtype = vllm_config.model_config.dtype
        if dtype != torch.float32:
            raise ValueError(f"the titan-audit vLLM model runs in float32 only, got dtype {dtype}")
        self.config = config
        self.batch_invariant = batch_invariant_requested(vllm_config)
        with torch.device("meta"):
            model = Transformer(config)
        self.model = model.to_empty(device=torch.get_default_device()).to(dtype).requires_grad_(False)
        # One gemm for q/k/v and one for gate/up: their weights become row blocks of one matrix
        # (the parameters are views into it, so loads and in-place syncs write the fused matrix)
        self._qkv = [_fuse(block.self_attn, ("q_proj", "k_proj", "v_proj")) for block in self.model.layers]
        self._gate_up = [
            _fuse(block.mlp, ("gate_proj", "up_proj")) if isinstance(block.mlp, FeedForward) else None
            for block in self.model.layers
        ]
        self.attn = nn.ModuleList(
            Attention(
                config.num_attention_heads,
                config.head_dim,
                config.head_dim**-0.5,
                num_kv_heads=config.num_key_value_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn",
                attn_backend=TitanAttentionBackend,
            )
            for i in range(config.num_hidden_layers)
        )

    # -- the vLLM interface ----------------------------------------------------------------------
    def _mode(self):
        # already on (the in-process generator turns it on around a whole generate call): no-op
        return bi.enabled() if self.batch_invariant and not bi.is_enabled() else contextlib.nullcontext()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, D]."""
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        from vllm.model_executor.layers.attention.attention import get_attention_context

        with self._mode():
            h_ND = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            cos_Nd, sin_Nd = self.model.rope.lookup(positions.long())
            # apply_rope's [B, H, T, d] layout with B = tokens, T = 1: cos/sin [N, 1, d]
            cos_N1d, sin_N1d = cos_Nd[:, None], sin_Nd[:, None]
            layers = self.model.layers
            x_ND = layers[0].input_layernorm(h_ND)
            for i, block in enumerate(layers):
                context = get_attention_context(self.attn[i].layer_name)
                attn_ND = self._attention(i, block.self_attn, x_ND, cos_N1d, sin_N1d, context)
                norm = block.post_attention_layernorm
                h_ND, x_ND = ops.add_rms_norm(h_ND, attn_ND, norm.weight, norm.eps)
                if self._gate_up[i] is None:  # MoE: the block's module on a [1, N, D] batch
                    mlp_ND = block.mlp(x_ND[None])[0]
                else:
                    mlp_ND = self._mlp(i, block.mlp, x_ND)
                # the residual add and the next norm (the next block's input norm, or the final one)
                norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                h_ND, x_ND = ops.add_rms_norm(h_ND, mlp_ND, norm.weight, norm.eps)
            return x_ND

    def _attention(self, i: int, attn, x_ND, cos_N1d, sin_N1d, context) -> torch.Tensor:
        """models.attention.Attention.forward with q/k/v from one gemm, q- and k-norm in one call
        (per-head rows: the same bits), RoPE of q and k in one call (element-wise: the same bits),
        and the attention over vLLM's paged cache (`attention.TitanAttentionImpl.attend`)."""
        metadata, layer, kv_cache, _ = context
        n = x_ND.shape[0]
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv_NHd = ops.linear(x_ND, self._qkv[i]).view(n, hq + 2 * hkv, d)
        qk_NHd, v_NHd = qkv_NHd[:, : hq + hkv], qkv_NHd[:, hq + hkv :]
        if attn.q_norm is not None:  # q/k-norm and RoPE (models.attention's), fused in BI inference
            assert attn.q_norm.eps == attn.k_norm.eps, (attn.q_norm.eps, attn.k_norm.eps)
            weight_Hd = torch.cat((attn.q_norm.weight.expand(hq, d), attn.k_norm.weight.expand(hkv, d)))
            qk_NHd = ops.rms_norm_rope(qk_NHd[:, None], weight_Hd, cos_N1d, sin_N1d, attn.q_norm.eps)[:, :, 0]
        else:
            qk_NHd = apply_rope(qk_NHd[:, :, None], cos_N1d, sin_N1d)[:, :, 0]
        if metadata is None:  # vLLM's warm-up / profiling run: no cache yet
            out_NF = x_ND.new_zeros((n, hq * d))
        else:
            out_NF = layer.impl.attend(qk_NHd[:, :hq], qk_NHd[:, hq:], v_NHd, kv_cache, metadata)
        return ops.linear(out_NF, attn.o_proj.weight)

    def _mlp(self, i: int, mlp: FeedForward, x_ND: torch.Tensor) -> torch.Tensor:
        """mlp.FeedForward.forward with gate and up from one gemm."""
        gate_up_NI = ops.linear(x_ND, self._gate_up[i])
        hidden = gate_up_NI.shape[1] // 2
        return ops.linear(ops.silu_mul(gate_up_NI[:, :hidden], gate_up_NI[:, hidden:]), mlp.down_proj.weight)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, V]: the LM head of `Transformer.forward`."""
        with self._mode():
            return ops.linear(hidden_states, self.model.output_weight)

    # -- weights ----------------------------------------------------------------------------------
    def titan_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in; the set of our parameter names loaded (vLLM checks it)."""
        own = self.model.state_dict()
        loaded: set[str] = set()
        experts: dict[str, set[int]] = {}
        with torch.no_grad():
            for hf_name, tensor in weights:
                name = hf_name.removeprefix("model.")
                if name == "lm_head.weight" and self.model.lm_head is None:
                    continue  # tied: the embedding is the head
                match = _EXPERT.match(name)
                if match:
                    layer, expert, proj = match.groups()
                    name = f"layers.{layer}.mlp.experts.{proj}"
                    target = own[name][int(expert)]
                    experts.setdefault(name, set()).add(int(expert))
                else:
                    if name not in own:
                        raise ValueError(f"checkpoint tensor {hf_name!r} has no counterpart in the titan-audit model")
                    target = own[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} is {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                if not match:
                    loaded.add(name)
        for name, seen in experts.items():
            if len(seen) == own[name].shape[0]:
                loaded.add(name)
        for block, qkv, gate_up in zip(self.model.layers, self._qkv, self._gate_up):  # still the storage
            assert block.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr(), "q/k/v no longer views of one matrix"
            assert gate_up is None or block.mlp.gate_proj.weight.data_ptr() == gate_up.data_ptr()
        params = {n for n, _ in self.named_parameters()}
        return {f"model.{n}" for n in loaded if f"model.{n}" in params}
