"""The decoder: embedding, N pre-norm blocks (attention + SwiGLU MLP or MoE), final norm, LM head.

    logits = model(tokens, positions=None, cache=None, doc_ids=None)
    logits_NV = model(tokens, logits_rows=rows_N)   # only the token rows b * T + t in rows_N
    logprobs_N = model(tokens, logits_rows=rows_N, logprob_targets=targets_N, temperature=t)

One forward for every use:
- training / scoring: `tokens` [B, T]; positions default to 0..T-1;
- packed documents: `doc_ids` [B, T] (a document = a run of equal ids, < 0 = padding); attention
  stays inside each document and positions default to the index inside the document;
- prefill / decode: `cache` is a `ContiguousKVCache` (or `.rows(...)` of one) or a
  `PagedKVCache.batch(...)`; the T new tokens of each row are appended after the row's cached
  tokens, positions default to the cache slots.
`tokens` may also be 1-D [T] (one sequence; logits [T, V]).
`logits_rows` (int64 [N], distinct, indices into the B * T token rows, row b * T + t) computes
the LM head at those rows only and returns [N, V]: the full forward's rows, bit for bit in BI
mode, gradients included (models/head_rows.py); log-probs and prefills need few of the rows.
With `logprob_targets` (int [N], in [0, V)) it returns instead the float32 log-probs [N] of those
targets under log_softmax(logits / temperature), the bits of computing them from those logits,
gradients included; in BI mode on CPU without ever holding [N, V] (models/chunked_head.py).

Guarantees (batch-invariant mode, `titan_audit.batch_invariant.enabled()`): every op but
attention acts on one token's row through `ops` (BI matmuls/norms/softmax, position-independent
activations, table RoPE), and attention follows the BI attention contract. Hence a token's
logits are bitwise the same from a full forward, a chunked prefill or a decode step from either
cache, alone or in any batch, packed or not. Outside BI mode the same math runs on native kernels
(parity with HF transformers within float32 tolerance).

MoE load balancing: `model(tokens, ..., return_aux_loss=True)` returns (logits, aux) with aux the
Switch/Qwen3-MoE load-balancing loss of this call's real tokens (moe.py; padding tokens of packed
rows excluded), computed from this call's tokens alone.

Compute dtype: `set_compute_dtype(torch.bfloat16)` runs the forward with each parameter cast once
per call (`p.to(dtype)` inside the autograd graph, shared by tied uses; module hooks still run,
via `torch.func.functional_call` per block); the parameters, and so their gradients, keep their
own dtype (fp32 master weights: backward rounds each gradient in the compute dtype, then the
cast's backward widens it exactly). Norm statistics, RoPE, router softmax and log-probs still run
in float32 (ops.py, rope.py, logprobs.py). Activation checkpointing recomputes with the same casts.

Switches: `set_activation_checkpointing(True)` recomputes each block in backward (the model has
no randomness, so the recompute is bitwise the forward); `set_compile(True)` compiles each block:
in BI mode with the `aot_eager` backend (graph capture, the same kernels, tested bitwise equal to
eager; the BI attention kernel and the grouped experts, which have data-dependent control flow,
stay opaque and run eagerly), outside BI mode with inductor, which fuses kernels and is NOT
bitwise equal to eager (a warning says so once). On CPU, compiling brings no speed-up for these
sizes; it is there for GPU runs.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_audit.models import chunked_head, head_rows, ops, tied
from titan_audit.models.attention import Attention
from titan_audit.models.config import ModelConfig
from titan_audit.models.mlp import FeedForward
from titan_audit.models.moe import MoE, RouterStats, load_balancing_loss
from titan_audit.models.norm import RMSNorm
from titan_audit.models.packing import PackedLayout
from titan_audit.models.rope import RotaryTable

BI_COMPILE_BACKEND = "aot_eager"


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.qk_norm,
            config.rms_norm_eps,
        )
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = MoE(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        cache_step: object | None = None,
        packing: PackedLayout | None = None,
        with_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats | None]:
        """The block's output; with `with_stats`, (output, the MoE layer's RouterStats over the
        real tokens, or None for a dense layer)."""
        attn = self.self_attn(self.input_layernorm(x_BTD), cos_BTd, sin_BTd, self.layer, cache_step, packing)
        norm = self.post_attention_layernorm  # h = x + attn, then its norm (one fused kernel in BI inference)
        h_BTD, normed_BTD = ops.add_rms_norm(x_BTD, attn, norm.weight, norm.eps)
        if not with_stats:
            return h_BTD + self.mlp(normed_BTD)
        if not isinstance(self.mlp, MoE):
            return h_BTD + self.mlp(normed_BTD), None
        token_mask = None if packing is None else packing.valid_N.view(x_BTD.shape[:2])
        out_BTD, stats = self.mlp(normed_BTD, token_mask, return_stats=True)
        return h_BTD + out_BTD, stats


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rope = RotaryTable(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.activation_checkpointing = False
        self.compute_dtype: torch.dtype | None = None
        self.compile_enabled = False
        self._compiled: dict[tuple[int, bool], nn.Module] = {}
        self._warned_inductor = False

    # -- switches -------------------------------------------------------------------------------
    def set_activation_checkpointing(self, enabled: bool) -> Transformer:
        """Recompute each block's activations in backward (training without a cache only)."""
        self.activation_checkpointing = bool(enabled)
        return self

    def set_compute_dtype(self, dtype: torch.dtype | None) -> Transformer:
        """Run forward (and so backward) with every parameter cast to `dtype` (e.g. bfloat16)
        while the parameters keep their own dtype (fp32 master weights): the cast is part of the
        autograd graph, so `.grad` arrives in the parameters' dtype. None: no cast."""
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"compute dtype must be a floating dtype, got {dtype}")
        self.compute_dtype = dtype
        return self

    def set_compile(self, enabled: bool) -> Transformer:
        """torch.compile each block; see the module doc for what stays bitwise."""
        self.compile_enabled = bool(enabled)
        self._compiled = {}
        return self

    @staticmethod
    def compile_is_bitwise() -> bool:
        """True iff compiled blocks now run with the backend that keeps eager bits (BI mode)."""
        return ops.bi_mode()

    def _block_fn(self, layer: int) -> nn.Module:
        if not self.compile_enabled:
            return self.layers[layer]
        bi = ops.bi_mode()
        key = (layer, bi)
        if key not in self._compiled:
            if not bi and not self._warned_inductor:
                warnings.warn(
                    "titan_audit.models: torch.compile outside batch-invariant mode uses inductor, "
                    "whose fused kernels are NOT bitwise equal to eager; enable batch-invariant "
                    f"mode to compile with the bitwise-preserving {BI_COMPILE_BACKEND!r} backend",
                    stacklevel=3,
                )
                self._warned_inductor = True
            backend = BI_COMPILE_BACKEND if bi else "inductor"
            self._compiled[key] = torch.compile(self.layers[layer], backend=backend, dynamic=True)
        return self._compiled[key]

    # -- forward --------------------------------------------------------------------------------
    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: object | None = None,
        doc_ids: torch.Tensor | None = None,
        return_aux_loss: bool = False,
        logits_rows: torch.Tensor | None = None,
        logprob_targets: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, V] (in the compute dtype), or [N, V] at `logits_rows` (float32 log-probs
        [N] with `logprob_targets`); with `return_aux_loss`, (logits, the MoE load-balancing loss
        of this call's real tokens: a float32 scalar, 0 without MoE layers)."""
        if logprob_targets is not None and logits_rows is None:
            raise ValueError("logprob_targets needs logits_rows (the rows whose targets they are)")
        squeeze = tokens.dim() == 1
        tokens_BT = self._check_tokens(tokens)
        batch, seq = tokens_BT.shape
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a KV cache")
            doc_ids = doc_ids.unsqueeze(0) if squeeze and doc_ids.dim() == 1 else doc_ids
            if doc_ids.shape != tokens_BT.shape or doc_ids.is_floating_point():
                raise ValueError(
                    f"doc_ids must be an integer tensor shaped like tokens {tuple(tokens_BT.shape)}, "
                    f"got {doc_ids.dtype} {tuple(doc_ids.shape)}"
                )

        cache_step = packing = None
        if cache is not None:
            if not hasattr(cache, "begin"):
                raise ValueError(
                    f"cache must be a ContiguousKVCache, ContiguousKVCache.rows(...) or "
                    f"PagedKVCache.batch(...), got {type(cache).__name__}"
                )
            cache_step = cache.begin(seq)
            if cache_step.q_pos_BT.shape[0] != batch:
                raise ValueError(f"the cache holds {cache_step.q_pos_BT.shape[0]} rows but tokens have {batch}")
            default_positions = cache_step.q_pos_BT
        elif doc_ids is not None:
            packing = PackedLayout(doc_ids.long())
            default_positions = packing.rope_positions_BT
        else:
            default_positions = torch.arange(seq, device=tokens_BT.device).expand(batch, seq)
        positions_BT = default_positions if positions is None else self._check_positions(positions, batch, seq)
        cos_BTd, sin_BTd = self.rope.lookup(positions_BT.to(tokens_BT.device))

        cast = self._cast_parameters()
        call = self._call if cast is None else functools.partial(self._call_cast, cast)
        embed_weight = self.embed_tokens.weight
        link = tied.TiedLink() if self._links_tied_grads(cast) else None
        if link is not None:
            h_BTD = tied.embedding(tokens_BT, embed_weight, link)
        else:
            h_BTD = F.embedding(tokens_BT, embed_weight if cast is None else cast[id(embed_weight)])
        stats: list[RouterStats] = []
        for layer in range(len(self.layers)):
            block = functools.partial(call, self._block_fn(layer))
            if self.activation_checkpointing and cache_step is None and torch.is_grad_enabled():
                out = checkpoint(block, h_BTD, cos_BTd, sin_BTd, None, packing, return_aux_loss, use_reentrant=False)
            else:
                out = block(h_BTD, cos_BTd, sin_BTd, cache_step, packing, return_aux_loss)
            if return_aux_loss:
                h_BTD, layer_stats = out
                if layer_stats is not None:
                    stats.append(layer_stats)
            else:
                h_BTD = out
        output_weight = self.output_weight if cast is None else cast[id(self.output_weight)]
        if logits_rows is not None:
            normed_MD = call(self.norm, h_BTD).reshape(batch * seq, -1)
            rows_N = self._check_rows(logits_rows, batch * seq).to(normed_MD.device)
            if logprob_targets is not None:
                logits_BTV = chunked_head.logprobs_at_rows(
                    normed_MD, output_weight, rows_N, logprob_targets, temperature, link
                )
            else:
                logits_BTV = head_rows.head_at_rows(normed_MD, output_weight, rows_N, link)
            squeeze = False  # already [N, V]
        elif link is not None:
            logits_BTV = tied.head(call(self.norm, h_BTD), output_weight, link)
        else:
            logits_BTV = ops.linear(call(self.norm, h_BTD), output_weight, gather_output=True)
        if cache_step is not None:
            cache_step.commit()
        logits = logits_BTV[0] if squeeze else logits_BTV
        if not return_aux_loss:
            return logits
        num_tokens = batch * seq if packing is None else int(packing.valid_N.sum())
        return logits, load_balancing_loss(stats, num_tokens, self.config.num_experts)

    def _links_tied_grads(self, cast: dict[int, torch.Tensor] | None) -> bool:
        """Whether this forward's tied embedding and LM head share one weight gradient pass
        (models/tied.py: BI mode, float32 weight with a backend, no cast; the plain path's bits)."""
        return self.lm_head is None and cast is None and ops.bi_mode() and tied.applies(self.embed_tokens.weight)

    # -- compute dtype --------------------------------------------------------------------------
    def _cast_parameters(self) -> dict[int, torch.Tensor] | None:
        """{id(parameter): parameter cast to the compute dtype} (one autograd cast per parameter
        per forward, shared by tied uses), or None when no parameter needs a cast."""
        dtype = self.compute_dtype
        if dtype is None or all(p.dtype == dtype for p in self.parameters()):
            return None
        if self.compile_enabled:
            raise ValueError("set_compile(True) cannot be combined with a compute dtype other than the parameters'")
        return {id(p): p.to(dtype) for p in self.parameters()}

    @staticmethod
    def _call(module: nn.Module, *args: object) -> object:
        return module(*args)

    @staticmethod
    def _call_cast(cast: dict[int, torch.Tensor], module: nn.Module, *args: object) -> object:
        """module(*args) with every parameter replaced by its cast (the module's hooks still run)."""
        params = {name: cast[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}
        return torch.func.functional_call(module, params, args)

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be int64 or int32, got {tokens.dtype}")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [B, T] or [T] with T > 0, got {tuple(tokens.shape)}")
        vocab = self.config.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]")
        return tokens

    @staticmethod
    def _check_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        if rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool:
            raise ValueError(f"logits_rows must be a 1-D integer tensor, got {rows.dtype} {tuple(rows.shape)}")
        rows = rows.long()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(
                f"logits_rows must lie in [0, {num_rows}) (B * T), got [{int(rows.min())}, {int(rows.max())}]"
            )
        if int(torch.unique(rows).numel()) != rows.numel():
            raise ValueError("logits_rows must be distinct")
        return rows

    @staticmethod
    def _check_positions(positions: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        if positions.is_floating_point():
            raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
        if positions.shape == (seq,):
            return positions.long().expand(batch, seq)
        if positions.shape != (batch, seq):
            raise ValueError(f"positions must be [T] or [B, T] = [{batch}, {seq}], got {tuple(positions.shape)}")
        return positions.long()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
