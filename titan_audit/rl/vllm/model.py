"""`TitanForCausalLM`: the models/ transformer as an out-of-tree vLLM architecture.

vLLM builds it from a checkpoint directory written by `models.save_pretrained` (HF layout,
`config.json` read by `models.hf_config`, so Qwen3 / Qwen3-MoE / Llama checkpoints of models/
load unchanged) when the engine is started with `hf_overrides={"architectures": [ARCHITECTURE]}`.

What runs: a `models.Transformer` built from that config holds every weight, and the forward
below calls its modules and the same `models.ops` functions in the same order as
`Transformer.forward` / `Block.forward` / `models.attention.Attention.forward`: embedding,
RMSNorms, q/k/v projections, q/k-norm, RoPE from the model's own table, o-projection, SwiGLU MLP
or MoE, final norm, LM head. vLLM's flat `[num_tokens]` batch (every scheduled token of every
request) is one `[1, num_tokens, D]` row block: every op but attention acts on one token's row,
and in batch-invariant mode a row's bits do not depend on the other rows. Attention goes
through a vLLM `Attention` layer per block (so vLLM allocates and schedules the paged KV cache)
whose backend is ours (`attention.py`). Hence in BI mode a token's logits are bitwise those of
the trainer's full forward of its sequence (guarantee G4; tests/rl/test_vllm_parity.py).

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
from titan_audit.models.rope import apply_rope
from titan_audit.models.transformer import Transformer

ARCHITECTURE = "TitanAuditForCausalLM"
CONFIG_KEY = "titan_audit"
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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
        return bi.enabled() if self.batch_invariant else contextlib.nullcontext()

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
        with self._mode():
            h_1ND = (self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds)[None]
            cos_1Nd, sin_1Nd = self.model.rope.lookup(positions.long()[None])
            for i, block in enumerate(self.model.layers):
                attn_1ND = self._attention(i, block.self_attn, block.input_layernorm(h_1ND), cos_1Nd, sin_1Nd)
                h_1ND = h_1ND + attn_1ND
                h_1ND = h_1ND + block.mlp(block.post_attention_layernorm(h_1ND))
            return self.model.norm(h_1ND)[0]

    def _attention(
        self, i: int, attn, x_1ND: torch.Tensor, cos_1Nd: torch.Tensor, sin_1Nd: torch.Tensor
    ) -> torch.Tensor:
        """models.attention.Attention.forward, with the attention reduction in vLLM's layer."""
        n = x_1ND.shape[1]
        q_1NHd = ops.linear(x_1ND, attn.q_proj.weight).view(1, n, attn.num_heads, attn.head_dim)
        k_1NHd = ops.linear(x_1ND, attn.k_proj.weight).view(1, n, attn.num_kv_heads, attn.head_dim)
        v_1NHd = ops.linear(x_1ND, attn.v_proj.weight).view(1, n, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q_1NHd = attn.q_norm(q_1NHd)
            k_1NHd = attn.k_norm(k_1NHd)
        q_1HNd = apply_rope(q_1NHd.transpose(1, 2), cos_1Nd, sin_1Nd)
        k_1HNd = apply_rope(k_1NHd.transpose(1, 2), cos_1Nd, sin_1Nd)
        out_NF = self.attn[i](
            q_1HNd[0].transpose(0, 1).contiguous(),
            k_1HNd[0].transpose(0, 1).contiguous(),
            v_1NHd[0].contiguous(),
        )
        return ops.linear(out_NF.view(1, n, attn.num_heads * attn.head_dim), attn.o_proj.weight)

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
        params = {n for n, _ in self.named_parameters()}
        return {f"model.{n}" for n in loaded if f"model.{n}" in params}
