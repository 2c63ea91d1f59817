"""Shared small models for tests/models (module-scope fixtures; a few hundred K parameters), and
`linears_in_another_order`, the constructed difference of the negative controls."""

import contextlib
from collections.abc import Iterator

import pytest
import torch

from titan_audit import batch_invariant, models
from titan_audit.models import ops

SMALL_DENSE = models.ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    rope_theta=10_000.0,
)
SMALL_MOE = SMALL_DENSE.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# Mixed layers (layer 0 dense via mlp_only_layers), a shared expert, un-normalised top-k.
SMALL_MOE_SHARED = SMALL_MOE.replace(
    num_hidden_layers=3,
    mlp_only_layers=(0,),
    shared_expert_intermediate_size=48,
    norm_topk_prob=False,
)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # The numerics fingerprint fixes the intra-op thread count; tests share 2 cores.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def dense_model():
    return models.build(SMALL_DENSE, seed=1).eval()


@pytest.fixture(scope="module")
def moe_model():
    return models.build(SMALL_MOE, seed=2).eval()


@pytest.fixture(scope="module")
def moe_shared_model():
    return models.build(SMALL_MOE_SHARED, seed=3).eval()


def _random_tokens(seed: int, *shape: int, vocab: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=generator)


@pytest.fixture(scope="session")
def make_tokens():
    """make_tokens(seed, *shape, vocab=256): reproducible random token ids."""
    return _random_tokens


@contextlib.contextmanager
def linears_in_another_order(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For the block, every linear of the model (`models.ops.linear`, BI mode only) as two
    batch-invariant gemms over K cut at K // 2 + 1, added: the same kernel and the same
    mathematics in another order of the sum. A negative control runs one side of an invariance
    check in it, a difference the project constructs (the same on every CPU), so the comparison
    is shown able to fail. The cut is off every v2 block boundary (a power-of-two split of K)."""

    def split(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        assert ops.bi_mode(), "linears_in_another_order is a BI-mode control"
        cut = weight.shape[-1] // 2 + 1
        out = batch_invariant.linear(x[..., :cut], weight[:, :cut]) + batch_invariant.linear(
            x[..., cut:], weight[:, cut:]
        )
        return out if bias is None else out + bias

    with monkeypatch.context() as patch:
        patch.setattr(ops, "linear", split)
        yield
