"""paged_attention: reading keys through a block table gives the dense kernel's bits, on every ISA variant.

Proves, for block tables of shuffled, non-contiguous blocks, rows of different lengths (one
spanning several 128-key chunks), block sizes that do not divide the chunk (1, 5, 7, 16, 33),
query positions off the block boundaries, GQA groups 1..4, decode (Tq = 1) and prefill chunks
(Tq > 1), float32, float64 and bfloat16 caches, and both cache layouts we read (the model's
token-major store, vLLM's interleaved key/value block): out and lse equal, bitwise, the dense
kernel's over the same keys gathered into [B, Hkv, S, D], under every variant this CPU runs and
for 1 and 2 threads. Cache slots no row holds are NaN and stay invisible. Negative controls
(constructed): swapping two blocks of a row's table (the same keys in another order, every one
visible to the query) or adding 1 to one element of one visible key gives other bits than the
dense call. Bad input (a gradient to record, an out-of-range table entry, a row longer than its
table, mismatched dtypes) is a ValueError. On the Triton backend (Triton's interpreter on CPU
tensors; skipped without triton) the paged entry over the model's strided store equals its dense
entry over the gathered keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batch_invariant._helpers import num_threads

from titan_audit.audit import bitwise_equal
from titan_audit.batch_invariant.cpu import _lib
from titan_audit.batch_invariant.cpu.attention import KEY_CHUNK, attention_forward, paged_attention


def _paged_case(
    lengths: list[int],
    block_size: int,
    hkv: int,
    group: int,
    dim: int,
    tq: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    layout: str = "model",
) -> dict:
    """A paged cache holding rows of `lengths` keys in shuffled blocks (spare blocks and unheld
    slots NaN), the queries: the last `tq` positions of each row (numpy RNG values)."""
    rng = np.random.default_rng(seed)
    blocks_per_row = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_per_row) + 3  # spare blocks no row uses
    order = rng.permutation(num_blocks).tolist()
    width = max(blocks_per_row)
    table = torch.zeros(len(lengths), width, dtype=torch.long)  # padding entries: block 0
    for b, count in enumerate(blocks_per_row):
        table[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    # the model's PagedKVCache: a [block, slot, kv_head, head_dim] store each for k and v; the vLLM
    # backend: one [block, slot, kv_head, key|value, head_dim] store. Both read as [block, kv_head,
    # slot, head_dim] views.
    keys_values = torch.full((2, num_blocks, block_size, hkv, dim), float("nan"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        for j in range(n):
            blk, slot = int(table[b, j // block_size]), j % block_size
            keys_values[:, blk, slot] = torch.from_numpy(rng.standard_normal((2, hkv, dim)))
    if layout == "model":
        k_store, v_store = keys_values.to(dtype)
        k_view, v_view = k_store.transpose(1, 2), v_store.transpose(1, 2)
    else:
        kv = keys_values.permute(1, 2, 3, 0, 4).to(dtype).contiguous()
        k_view, v_view = kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
    q = torch.from_numpy(rng.standard_normal((len(lengths), hkv * group, tq, dim))).to(dtype)
    positions = torch.tensor([[n - tq + i for i in range(tq)] for n in lengths])
    return dict(q=q, k=k_view, v=v_view, table=table, lens=torch.tensor(lengths), positions=positions)


def _dense(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense kernel over each row's blocks gathered in table order ([B, Hkv, width * bs, D])."""
    table, k, v = case["table"], case["k"], case["v"]
    batch, width = table.shape
    _, hkv, block_size, dim = k.shape

    def gather(x):  # noqa: ANN001, ANN202
        return x.index_select(0, table.reshape(-1)).transpose(1, 2).reshape(batch, width * block_size, hkv, dim)

    scale = dim**-0.5
    return attention_forward(
        case["q"], gather(k).transpose(1, 2), gather(v).transpose(1, 2), scale, True, case["positions"], None
    )


def _paged(case: dict, table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    table = case["table"] if table is None else table
    dim = case["q"].shape[-1]
    return paged_attention(case["q"], case["k"], case["v"], table, case["lens"], case["positions"], dim**-0.5)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


CASES = {
    # lengths, block_size, hkv, group, dim, tq
    "decode-gqa4-bs16": ([37, 300, 129, 1], 16, 2, 4, 64, 1),
    "decode-bs7-many-chunks": ([5, 700, 256, 130], 7, 1, 2, 40, 1),
    "prefill-chunk-bs5": ([23, 260, 140], 5, 2, 1, 32, 9),
    "bs1-odd-dim": ([3, 290], 1, 1, 3, 33, 2),
    "bs33-prefill-across-chunks": ([400, 97], 33, 1, 2, 16, 90),
}


@pytest.mark.parametrize("layout", ["model", "vllm"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_equals_dense_bitwise_on_every_variant(name: str, layout: str) -> None:
    lengths, block_size, hkv, group, dim, tq = CASES[name]
    case = _paged_case(lengths, block_size, hkv, group, dim, tq, seed=len(name), layout=layout)
    assert max(lengths) > 2 * KEY_CHUNK  # some row spans several chunks
    for isa in _lib.available_isas():
        with _lib.forced_isa(isa):
            for threads in (1, 2):
                with num_threads(threads):
                    dense, paged = _dense(case), _paged(case)
                assert _same(paged, dense), f"{name} ({layout}): {isa}, {threads} threads"
                assert bool(torch.isfinite(paged[0]).all())  # the NaN slots stayed invisible


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_paged_equals_dense_in_float64_and_bfloat16(dtype: torch.dtype) -> None:
    """float64 runs the float64 kernel on the cache in place; a bfloat16 cache has its tabled
    blocks converted (exactly) to float32 first, as the dense call converts its gathered keys."""
    case = _paged_case([300, 41, 7], 8, 2, 2, 32, 3, seed=11, dtype=dtype)
    dense, paged = _dense(case), _paged(case)
    assert paged[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert _same(paged, dense)


@pytest.mark.control
def test_negative_control_swapping_two_blocks_of_a_table_changes_the_bits() -> None:
    """Blocks 1 and 3 of row 1 swapped in the table: the decode query still sees every key of
    both (the same keys, in another order), so only the order of the sums differs."""
    case = _paged_case([37, 300, 129], 16, 2, 4, 64, 1, seed=3)
    dense = _dense(case)
    assert _same(_paged(case), dense)
    swapped = case["table"].clone()
    swapped[1, [1, 3]] = swapped[1, [3, 1]]
    out, _ = _paged(case, swapped)
    assert not bitwise_equal(out[1], dense[0][1])
    assert bitwise_equal(out[0], dense[0][0]) and bitwise_equal(out[2], dense[0][2])  # other rows untouched


@pytest.mark.control
def test_negative_control_perturbing_one_visible_key_changes_the_bits() -> None:
    case = _paged_case([37, 300, 129], 16, 2, 4, 64, 1, seed=3)
    dense = _dense(case)
    key = 200  # a key of row 1 its query sees
    blk, slot = int(case["table"][1, key // 16]), key % 16
    case["k"][blk, 0, slot, 5] += 1.0
    out, _ = _paged(case)
    assert not bitwise_equal(out[1], dense[0][1])
    assert bitwise_equal(out[0], dense[0][0])


def test_bad_input_is_a_value_error() -> None:
    case = _paged_case([20, 9], 4, 1, 2, 8, 1, seed=5)
    num_blocks = case["k"].shape[0]
    bad_table = case["table"].clone()
    bad_table[0, 2] = num_blocks  # a block of a present key (keys 8..11 of row 0)
    with pytest.raises(ValueError, match=r"block_table entry of a present key lies outside \[0, "):
        _paged(case, bad_table)
    padded = case["table"].clone()
    padded[1, 3:] = num_blocks + 7  # entries past row 1's own blocks are never read
    assert _same(_paged(case, padded), _paged(case))
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(case["q"], case["k"], case["v"], case["table"], torch.tensor([21, 9]), case["positions"], 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(
            case["q"], case["k"], case["v"], case["table"], case["lens"], case["positions"], 1.0, max_seq_len=19
        )
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(case["q"].double(), case["k"], case["v"], case["table"], case["lens"], case["positions"], 1.0)
    with pytest.raises(ValueError, match=r"block_table \[2, n\] and seq_lens \[2\]"):
        paged_attention(case["q"], case["k"], case["v"], case["table"][:1], case["lens"], case["positions"], 1.0)
    q = case["q"].clone().requires_grad_()
    with pytest.raises(ValueError, match="forward-only"):
        paged_attention(q, case["k"], case["v"], case["table"], case["lens"], case["positions"], 1.0)
    with torch.no_grad():  # no autograd record: fine
        paged_attention(q, case["k"], case["v"], case["table"], case["lens"], case["positions"], 1.0)


@pytest.mark.triton
def test_triton_paged_entry_equals_its_dense_entry_on_the_models_store() -> None:
    """The Triton kernels (interpreter, CPU tensors) over the model's token-major store through a
    shuffled table equal the Triton dense entry over the gathered keys. Control: two blocks of a
    row swapped give other bits."""
    from batch_invariant._triton import triton_on_cpu

    case = _paged_case([45, 70], 4, 1, 2, 16, 1, seed=9)
    batch, width = case["table"].shape
    with triton_on_cpu() as be:
        dense_k, dense_v = (
            x.index_select(0, case["table"].reshape(-1))
            .transpose(1, 2)
            .reshape(batch, width * 4, 1, 16)
            .transpose(1, 2)
            for x in (case["k"], case["v"])
        )
        args = (case["lens"], case["positions"], 0.25)
        dense, _ = be.attention_forward(case["q"], dense_k, dense_v, 0.25, True, case["positions"], None)
        paged, _ = be.paged_attention(case["q"], case["k"], case["v"], case["table"], *args, max_seq_len=70)
        swapped = case["table"].clone()
        swapped[1, [2, 5]] = swapped[1, [5, 2]]
        control, _ = be.paged_attention(case["q"], case["k"], case["v"], swapped, *args, max_seq_len=70)
    assert bitwise_equal(paged, dense)
    assert not bitwise_equal(control[1], dense[1])
