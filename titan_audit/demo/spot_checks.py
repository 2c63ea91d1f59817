"""G2 spot-checks for the demo: batch invariance of the ops at several head dims, bit for bit.

Each check computes the same rows two ways that differ only in what a batch-invariant op must
ignore (the batch around a row, the number of query rows processed together, the keys a decode
step sees beyond its position) and compares the raw bits (audit.bitwise_equal). It runs once with
the batch-invariant ops (the verdict: must be identical) and once with native torch ops (reported,
never counted: whether they differ depends on what the CPU's libraries do for the shape).

The constructed control (`decode_matches_full_forward(True, decode_gemm_order=...)`): the model's
KV-cache decode summed in the other batch-invariant gemm order (batch_invariant/order.py) than its
full forward. tiny-dense's gemms over K = 256 and 768 split into 4 and 8 blocks under "v2" and one
chain under "v1", so the logits differ on any CPU: the comparison is shown able to fail.

- attention, per head dim D: a sample alone vs in a batch of 4 (full causal prefill); full
  prefill vs token-by-token decode against the growing KV cache; full prefill vs chunked prefill
  (chunks of 16 queries). GQA 8 query / 2 kv heads.
- matmul at K = 8*D: one row alone vs in a batch of 64 rows; log_softmax and rms_norm the same.
- the model: tiny-dense KV-cache decode logits vs one full forward (`decode_matches_full_forward`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from titan_audit import batch_invariant, models
from titan_audit.audit import bitwise_equal

MODEL = "tiny-dense"


@dataclass
class SpotCheck:
    check: str
    shape: str
    bi: str  # "identical" | "DIFFERENT"
    native: str  # "identical" | "differs" (reported, never counted)

    @property
    def passed(self) -> bool:
        return self.bi == "identical"

    def to_dict(self) -> dict:
        return asdict(self)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _native_attention(q, k, v, q_positions=None):
    """torch SDPA with GQA expanded; causal by absolute positions (queries at the last Tq slots)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    pos = torch.arange(tk - tq, tk) if q_positions is None else q_positions
    mask = torch.arange(tk)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_rows(attn, q, k, v, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, candidate) of one sample's attention output computed two ways."""
    t = q.shape[2]
    if mode == "batch":
        return attn(q[:1], k[:1], v[:1]), attn(q, k, v)[:1]
    full = attn(q[:1], k[:1], v[:1])
    if mode == "decode":
        steps = [attn(q[:1, :, i : i + 1], k[:1, :, : i + 1], v[:1, :, : i + 1]) for i in range(t)]
        return full, torch.cat(steps, dim=2)
    assert mode == "chunked"
    chunk = 16
    parts = [attn(q[:1, :, s : s + chunk], k[:1, :, : s + chunk], v[:1, :, : s + chunk]) for s in range(0, t, chunk)]
    return full, torch.cat(parts, dim=2)


def attention_checks(head_dim: int, seq: int = 48) -> list[SpotCheck]:
    g = _gen(head_dim)
    q = torch.randn(4, 8, seq, head_dim, generator=g)
    k = torch.randn(4, 2, seq, head_dim, generator=g)
    v = torch.randn(4, 2, seq, head_dim, generator=g)
    out = []
    labels = {
        "batch": "attention: sample alone vs in a batch of 4",
        "decode": "attention: full prefill vs token-by-token KV decode",
        "chunked": "attention: full prefill vs chunked prefill (16)",
    }
    for mode, label in labels.items():
        bi = bitwise_equal(*_attention_rows(batch_invariant.attention, q, k, v, mode))
        native = bitwise_equal(*_attention_rows(_native_attention, q, k, v, mode))
        out.append(
            SpotCheck(
                label,
                f"Hq=8 Hkv=2 T={seq} D={head_dim}",
                "identical" if bi else "DIFFERENT",
                "identical" if native else "differs",
            )
        )
    return out


def row_op_checks(head_dim: int) -> list[SpotCheck]:
    g = _gen(1000 + head_dim)
    k_dim = 8 * head_dim
    x = torch.randn(64, k_dim, generator=g)
    w = torch.randn(k_dim, 256, generator=g) / k_dim**0.5
    weight = torch.randn(k_dim, generator=g)
    ops = {
        "matmul": (lambda a: batch_invariant.matmul(a, w), lambda a: a @ w),
        "log_softmax": (lambda a: batch_invariant.log_softmax(a, dim=-1), lambda a: torch.log_softmax(a, dim=-1)),
        "rms_norm": (
            lambda a: batch_invariant.rms_norm(a, weight, 1e-6),
            lambda a: F.rms_norm(a, (k_dim,), weight, 1e-6),
        ),
    }
    out = []
    for name, (bi_op, native_op) in ops.items():
        bi = bitwise_equal(bi_op(x[:1]), bi_op(x)[:1])
        native = bitwise_equal(native_op(x[:1]), native_op(x)[:1])
        out.append(
            SpotCheck(
                f"{name}: row alone vs in a batch of 64",
                f"[64, {k_dim}]" + (" @ [.., 256]" if name == "matmul" else ""),
                "identical" if bi else "DIFFERENT",
                "identical" if native else "differs",
            )
        )
    return out


@torch.no_grad()
def decode_matches_full_forward(
    bi: bool, prompt_len: int = 24, new_tokens: int = 8, *, decode_gemm_order: str | None = None
) -> bool:
    """Do cached token-by-token decode logits equal one full forward's, bit for bit?
    `decode_gemm_order`: the decode (prefill and steps) sums its BI gemms in this order, the full
    forward in the current one (the constructed control: another order must differ)."""
    model = models.build(MODEL, seed=0)
    tokens = torch.randint(model.config.vocab_size, (1, prompt_len + new_tokens), generator=_gen(0))
    with batch_invariant.enabled(bi):
        full = model(tokens)
        order = batch_invariant.gemm_order(decode_gemm_order) if decode_gemm_order else contextlib.nullcontext()
        with order:
            cache = models.ContiguousKVCache(model.config, batch_size=1, max_len=prompt_len + new_tokens)
            steps = [model(tokens[:, :prompt_len], cache=cache)]
            for t in range(prompt_len, prompt_len + new_tokens):
                steps.append(model(tokens[:, t : t + 1], cache=cache))
    return bitwise_equal(torch.cat(steps, dim=1), full)


@torch.no_grad()
def run_spot_checks(head_dims: tuple[int, ...]) -> list[SpotCheck]:
    checks: list[SpotCheck] = []
    for d in head_dims:
        checks += attention_checks(d)
        checks += row_op_checks(d)
    bi, native = decode_matches_full_forward(True), decode_matches_full_forward(False)
    checks.append(
        SpotCheck(
            f"model {MODEL}: KV-cache decode logits vs one full forward",
            "prompt 24 + 8 decoded tokens",
            "identical" if bi else "DIFFERENT",
            "identical" if native else "differs",
        )
    )
    return checks
