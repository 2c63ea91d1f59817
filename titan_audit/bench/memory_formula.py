"""Memory per rank on paper: the terms docs/memory.md gives for data parallel and FSDP2, as code.

Guarantee: pure arithmetic on a dense model's shapes and a layout (no tensor is made), term by
term what docs/memory.md states; `bench memory` sets each measured peak beside `estimate(...)`,
and tests/bench/test_memory_suite.py checks the parameter counts against the real model and the
docs' tables against this module.

Bytes per rank, P parameters, W ranks, V microbatches, g = floor(log2(V/W)) + 1 (V/W a power of
two; otherwise 2 floor(log2(V/W)) + 1, the pool's bound, reduce.py), c the compute dtype's bytes,
P_max the largest parameter, P_L the largest FSDP2 group (a block, or the root: embedding, head
and final norm):

    peak = static + max(backward, pack, reduce, optimizer)
    data parallel  static    = 4P params + 8P AdamW (2 fp32 states) + g 4P gradient buffers
                               (+ the exchange's receive buffer 4P (W-1)/W across hosts)
    FSDP2          static    = (4P + 8P) / W shards and their states
                               + W = 1: g 4P partials (the tree's stacks, trainer/fsdp.py)
                               + W > 1: max(1, g - 1) 4P/W shard-sized partials (a round's top
                                 node stays in its received pieces until it must move) and
                                 4P/W of FSDP's reduce-scatter outputs, which it keeps as the
                                 sharded .grad until the microbatch's zero_grad
    both                     + the RoPE tables, 2 x 4 max_positions head_dim
    backward  = activations of one microbatch + its logits' gradient
                + data parallel: the largest parameter's fresh gradient, 4 P_max
                + FSDP2: the largest group's unsharded gradients (or parameters), c P_L,
                  and at W > 1 a block's exchange in flight (see pack), 2 x 4 P_B, less the
                  head's log-probs and their gradient, freed before the first exchange starts
    reduce    = FSDP2 at W > 1, while the largest group reduces (after its last backward op):
                its packed gradient 4 P_L, the pieces it receives 4 P_L, and the largest
                parameter's gradient, which autograd holds while FSDP's hook runs, 4 P_max
    pack      = FSDP2 at W > 1, while the largest group packs its gradient: its unsharded
                gradients c P_L, its packed gradient 4 P_L, and the exchange still in flight
                from the group before (a block of P_B parameters: its packed gradient and the
                pieces received), 2 x 4 P_B
    optimizer = torch's AdamW (foreach off): two temporaries of the largest parameter
                (sqrt, then / bias correction), 2 x 4 P_max (FSDP2: its shard, / W);
                the fused PortableAdamW: none.

The same-host exchange (trainer/shared_exchange.py) is one /dev/shm file per host, (W s + 1) 4P
bytes (s partial slots per rank, 1 when V/W is a power of two), mapped by every rank:
`exchange_per_host`, apart from the per-rank peak. Activations, counted from our model's saved
tensors (autograd's saved-tensor hooks on models/transformer.py; c = 4 float32, 2 bfloat16):
per layer and token, float32 4 (6h + 4i + 4q + 4kv + 2 n_q + n_kv + 2) bytes, bfloat16
16h + 8i + 10q + 10kv + 8 n_q + 4 n_kv + 8 bytes (h hidden, i intermediate, q = n_q d and
kv = n_kv d the query and key widths), plus an attention mask of c s^2 per layer and sequence;
the head saves float32 log-probabilities, 4 vocab bytes a token; in data parallel with bf16 compute
the bf16 casts of the parameters the forward used (2 bytes each) stay saved until the backward.
With activation checkpointing each block keeps its float32 input (4h a token) and one block's
activations (and casts) live at a time, recomputed in its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

MODES = ("dp", "fsdp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FP32 = 4  # bytes of a float32: master parameters, gradients, AdamW states


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shapes (models/config.py ModelConfig fields of the same meaning)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qk_norm: bool = True
    max_positions: int = 0  # the RoPE tables' rows (models/rope.py)

    @classmethod
    def of(cls, config: Any) -> Shape:
        """From a models ModelConfig; ValueError for an MoE model (the terms are a dense model's)."""
        if getattr(config, "num_experts", 0):
            raise ValueError(f"the memory formula is for dense models; this one has {config.num_experts} experts")
        return cls(
            vocab=config.vocab_size,
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            tied=config.tie_word_embeddings,
            qk_norm=config.qk_norm,
            max_positions=config.max_position_embeddings,
        )

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_params(self) -> int:
        """One decoder block: q, k, v, o, gate, up, down, two RMSNorms (and the q/k norms)."""
        h = self.hidden
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return 2 * h * self.q + 2 * h * self.kv + 3 * h * self.intermediate + norms

    @property
    def root_params(self) -> int:
        """What no block holds: the embedding, the LM head (unless tied) and the final norm (the
        FSDP2 root group, trainer/fsdp.py)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params

    @property
    def largest_param(self) -> int:
        """The largest single parameter tensor (the embedding, here)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.q)

    @property
    def largest_group(self) -> int:
        """The largest FSDP2 parameter group: a block or the root."""
        return max(self.block_params, self.root_params)


@dataclass(frozen=True)
class Layout:
    """How a step runs: mode, W ranks, V microbatches of `microbatch_size` x `seq_len` tokens."""

    mode: Literal["dp", "fsdp"]
    world_size: int
    microbatches: int
    seq_len: int
    microbatch_size: int = 1
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False
    fused_adamw: bool = False  # PortableAdamW's fused kernel (BI mode): no temporaries
    one_host: bool = True  # the same-host exchange file instead of a receive buffer

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.compute_dtype not in DTYPE_BYTES:
            raise ValueError(f"compute_dtype must be one of {tuple(DTYPE_BYTES)}, got {self.compute_dtype!r}")
        for name in ("world_size", "microbatches", "seq_len", "microbatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.microbatches % self.world_size:
            raise ValueError(f"W = {self.world_size} does not divide V = {self.microbatches}")


def gradient_buffers(microbatches: int, world_size: int) -> int:
    """g: gradient-sized buffers (DP) or shard-sized partials per group (FSDP2) held at once."""
    n = microbatches // world_size
    depth = n.bit_length() - 1  # floor(log2(V/W))
    return depth + 1 if n & (n - 1) == 0 else 2 * depth + 1


def slots_per_rank(microbatches: int, world_size: int) -> int:
    """Partials a rank sends in the exchange: one when V/W is a power of two (a whole subtree)."""
    n = microbatches // world_size
    return 1 if n & (n - 1) == 0 else n.bit_length()


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank, term by term; `peak` = sum(static) + the largest phase's sum (backward,
    pack, reduce, optimizer: transients that are never alive together)."""

    static: dict[str, int]
    phases: dict[str, dict[str, int]]  # "backward", "pack", "reduce", "optimizer" -> their terms
    exchange_per_host: int  # the same-host exchange file, mapped by every rank of the host

    @property
    def peak(self) -> int:
        return sum(self.static.values()) + max(sum(terms.values()) for terms in self.phases.values())

    def phase(self, name: str) -> int:
        return sum(self.phases[name].values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak,
            "static": dict(self.static),
            "phases": {name: dict(terms) for name, terms in self.phases.items()},
            "exchange_per_host_bytes": self.exchange_per_host,
        }


def activations(shape: Shape, layout: Layout) -> dict[str, int]:
    """One microbatch's saved tensors at the end of its forward (module doc), by part."""
    c = DTYPE_BYTES[layout.compute_dtype]
    h, i, q, kv, nq, nkv = shape.hidden, shape.intermediate, shape.q, shape.kv, shape.heads, shape.kv_heads
    if c == FP32:
        per_token = FP32 * (6 * h + 4 * i + 4 * q + 4 * kv + 2 * nq + nkv + 2)
    else:
        per_token = 16 * h + 8 * i + 10 * q + 10 * kv + 8 * nq + 4 * nkv + 8
    b, s = layout.microbatch_size, layout.seq_len
    block = b * s * per_token + b * c * s * s  # one block's saved tensors, its attention mask included
    casts = 2 * shape.block_params if c != FP32 and layout.mode == "dp" else 0
    out = {"head_logprobs": b * s * FP32 * shape.vocab}
    if layout.activation_checkpointing:
        out["block_inputs"] = shape.layers * b * s * FP32 * h
        out["one_block_recomputed"] = block + casts
    else:
        out["blocks"] = shape.layers * (block + casts)
    if casts:
        out["root_casts"] = 2 * shape.root_params
    return out


def estimate(shape: Shape, layout: Layout) -> Estimate:
    """The formula of the module doc for one layout."""
    W, V = layout.world_size, layout.microbatches
    P, g = shape.params, gradient_buffers(V, W)
    shards = 1 if layout.mode == "dp" else W
    static = {"params": FP32 * P // shards, "adamw_states": 2 * FP32 * P // shards}
    if layout.mode == "dp":
        static["gradient_buffers"] = g * FP32 * P
    elif W == 1:  # FSDP's copy of the gradient is the leaf itself: the stacks' g partials
        static["gradient_partials"] = g * FP32 * P
    else:  # the top node of a round stays in its received pieces until it must move
        static["gradient_partials"] = max(1, g - 1) * FP32 * P // W
        static["fsdp_sharded_grads"] = FP32 * P // W
    static["rope_tables"] = 2 * FP32 * shape.max_positions * shape.head_dim  # cos and sin, float32
    if layout.mode == "dp" and W > 1 and not layout.one_host:
        static["exchange_receive"] = FP32 * (W - 1) * math.ceil(P / W)
    b, s = layout.microbatch_size, layout.seq_len
    backward = {f"activations_{k}": v for k, v in activations(shape, layout).items()}
    backward["logits_gradient"] = b * s * FP32 * shape.vocab
    reduce, pack = {}, {}
    if layout.mode == "dp":
        backward["largest_gradient"] = FP32 * shape.largest_param
    else:
        L = shape.largest_group
        backward["unsharded_group"] = DTYPE_BYTES[layout.compute_dtype] * L
        if W > 1:  # at W = 1 FSDP copies instead of reducing, into what becomes a partial
            in_flight = 2 * FP32 * shape.block_params  # the group before's exchange: a block's
            # it starts after the head's backward freed the log-probs and their gradient
            head = backward["activations_head_logprobs"] + backward["logits_gradient"]
            backward["block_exchange_in_flight"] = max(0, in_flight - head)
            reduce = {
                "packed_group_gradient": FP32 * L,
                "received_group_pieces": FP32 * L,
                "held_gradient": FP32 * shape.largest_param,
            }
            pack = {
                "unsharded_group": DTYPE_BYTES[layout.compute_dtype] * L,
                "packed_group_gradient": FP32 * L,
                "block_exchange_in_flight": in_flight,
            }
    temporaries = 0 if layout.fused_adamw else 2 * FP32 * math.ceil(shape.largest_param / shards)
    exchange = 0
    if layout.mode == "dp" and W > 1 and layout.one_host:
        exchange = (W * slots_per_rank(V, W) + 1) * FP32 * P
    phases = {
        "backward": backward,
        "pack": pack,
        "reduce": reduce,
        "optimizer": {"adamw_temporaries": temporaries},
    }
    return Estimate(static, phases, exchange)


# ---------------------------------------------------------------------------------- on paper
QWEN3_8B = Shape(
    vocab=151_936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12_288, max_positions=40_960
)
LLAMA3_70B = Shape(
    vocab=128_256,
    hidden=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    head_dim=128,
    intermediate=28_672,
    qk_norm=False,
    max_positions=8192,
)
PAPER_MODELS = {"Qwen3-8B": QWEN3_8B, "Llama-3-70B": LLAMA3_70B}
PAPER_WORLD_SIZES = (8, 64, 512)
PAPER_MICROBATCHES_PER_RANK = 8  # V = 8 W: g = 4
PAPER_SEQ_LEN = 8192
GPU_BYTES = 80 * 10**9  # "fits an 80 GB GPU": at most 80e9 bytes (74.5 GiB of its 80 GiB)
GB = 10**9


def paper_layout(mode: str, world_size: int) -> Layout:
    """TorchTitan's recipe for these models: bf16 compute on fp32 masters, 1 x 8192-token
    microbatches, every block checkpointed, torch's AdamW, ranks on many hosts."""
    return Layout(
        mode,  # type: ignore[arg-type]
        world_size,
        PAPER_MICROBATCHES_PER_RANK * world_size,
        PAPER_SEQ_LEN,
        compute_dtype="bfloat16",
        activation_checkpointing=True,
        one_host=False,
    )


def paper_table() -> str:
    """docs/memory.md's on-paper table (Markdown), from `estimate` at every paper model, mode and W."""
    lines = [
        "| model | P | mode | W | V | static | backward | reduce | optimizer | peak per rank | fits 80 GB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, shape in PAPER_MODELS.items():
        for mode in MODES:
            for world_size in PAPER_WORLD_SIZES:
                layout = paper_layout(mode, world_size)
                e = estimate(shape, layout)
                reduce = max(e.phase("pack"), e.phase("reduce"))
                cells = [sum(e.static.values()), e.phase("backward"), reduce, e.phase("optimizer"), e.peak]
                lines.append(
                    f"| {name} | {shape.params / 1e9:.2f}B | {mode} | {world_size} | {layout.microbatches} | "
                    + " | ".join(f"{c / GB:,.1f} GB" for c in cells)
                    + f" | {'yes' if e.peak <= GPU_BYTES else 'no'} |"
                )
    return "\n".join(lines)
