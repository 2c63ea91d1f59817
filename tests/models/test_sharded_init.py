"""The seed init one piece at a time (models/init.py `init_range`, models/local_shard.py): any
element range, and any torch.chunk-style block (uneven dim-0 chunks, Shard(1) columns, both
composed), gets bit for bit the elements the whole-tensor init gives them. The reference is the
whole-tensor draw written out here (one Philox stream from counter 0, one Box-Muller pair per
64-bit word), not the code under test. Controls the test constructs: a range drawn one element
off, and a range drawn from the start of its Philox block without the in-block skip, differ.
An HF checkpoint read piece by piece (models/hf_shards.py) gives each block the stored bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_audit.batch_invariant.cpu.random import normal_from_bits
from titan_audit.deterministic import numpy_generator
from titan_audit.models import ModelConfig, build, get_preset, save_pretrained
from titan_audit.models.build import build_meta
from titan_audit.models.hf_shards import load_pretrained_into
from titan_audit.models.init import CHUNK, init_range
from titan_audit.models.local_shard import LocalBlock

SEED, NAME, STD = 7, "layers.0.mlp.down_proj.weight", 0.02
NUMEL = 2 * CHUNK + 37  # odd: the last pair's second sample is dropped; > 2 draws of CHUNK


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def whole(numel: int, seed: int = SEED, name: str = NAME) -> torch.Tensor:
    """The whole-tensor init: pairs = ceil(numel / 2) words from counter 0, cut to numel."""
    words = numpy_generator(seed, f"model-init/{name}", 0, 0).bit_generator.random_raw((numel + 1) // 2)
    return normal_from_bits(words.view(np.uint32), 0.0, STD)[:numel]


@pytest.fixture(scope="module")
def full() -> torch.Tensor:
    return whole(NUMEL)


# ranges: odd/even starts and stops, inside one pair, across Philox block edges (8 elements a
# block), across the CHUNK boundary, up to the odd end
RANGES = [(0, 1), (1, 2), (1, 4), (3, 5), (7, 9), (8, 16), (5, 27), (15, 17), (63, 65), (CHUNK - 3, CHUNK + 5)]
RANGES += [(NUMEL - 1, NUMEL), (NUMEL - 9, NUMEL), (CHUNK + 1, NUMEL - 2), (0, NUMEL), (12, 12)]


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_a_range_has_the_whole_inits_bits(full, start, stop):
    assert torch.equal(bits(init_range(SEED, NAME, STD, start, stop)), bits(full[start:stop]))


def test_control_a_range_drawn_one_element_off_differs(full):
    for start, stop in [(0, 16), (5, 27), (CHUNK - 3, CHUNK + 5)]:
        shifted = init_range(SEED, NAME, STD, start + 1, stop + 1)
        assert not torch.equal(bits(shifted), bits(full[start:stop]))


def test_control_ignoring_the_skip_inside_the_philox_block_differs(full):
    """A draw from the start of the range's block (the 4-word alignment left out) is wrong for
    every range that does not start on a block edge: the skip is load-bearing."""
    start, stop = 10, 30  # pair 5: block 1, word 1 of it
    generator = numpy_generator(SEED, f"model-init/{NAME}", 0, 0).bit_generator
    generator.advance(start // 2 // 4)
    words = generator.random_raw((stop - start + 1) // 2)
    unaligned = normal_from_bits(words.view(np.uint32), 0.0, STD)[: stop - start]
    assert not torch.equal(bits(unaligned), bits(full[start:stop]))
    assert torch.equal(bits(init_range(SEED, NAME, STD, start, stop)), bits(full[start:stop]))


def chunk_blocks(shape: tuple[int, ...], parts: int, dim: int, base: LocalBlock | None = None) -> list[LocalBlock]:
    """torch.chunk(base's piece, parts, dim) as blocks of the full tensor (FSDP2 / TP Shard(dim))."""
    base = base or LocalBlock(shape, (0,) * len(shape), shape)
    size = -(-base.local_shape[dim] // parts)  # ceil: torch.chunk's chunk size
    blocks = []
    for i in range(parts):
        lo, hi = min(i * size, base.local_shape[dim]), min((i + 1) * size, base.local_shape[dim])
        offset = list(base.offset)
        offset[dim] += lo
        local = list(base.local_shape)
        local[dim] = hi - lo
        blocks.append(LocalBlock(shape, tuple(offset), tuple(local)))
    return blocks


def block_init(block: LocalBlock) -> torch.Tensor:
    pieces = [init_range(SEED, NAME, STD, a, b) for a, b in block.flat_ranges()]
    return torch.cat(pieces).view(block.local_shape) if pieces else torch.empty(block.local_shape)


LAYOUTS = {
    # uneven dim-0 chunks at W = 3 (11 rows: 4, 4, 3) and W = 4 of 3 rows (one rank empty)
    "fsdp-w3": lambda s: chunk_blocks(s, 3, 0),
    "fsdp-w4-of-3-rows": lambda s: chunk_blocks((3, s[1]), 4, 0),
    "tp-shard1-w3": lambda s: chunk_blocks(s, 3, 1),  # columns: every row a separate range
    # FSDP2 over dp = 3 of each TP Shard(1) piece (tp = 2), and of each TP Shard(0) piece
    "fsdp3-of-tp-shard1": lambda s: [b for t in chunk_blocks(s, 2, 1) for b in chunk_blocks(s, 3, 0, t)],
    "fsdp3-of-tp-shard0": lambda s: [b for t in chunk_blocks(s, 2, 0) for b in chunk_blocks(s, 3, 0, t)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_block_of_a_layout_has_the_whole_inits_bits(layout):
    shape = (11, 37)  # odd rows and columns: pairs and Philox blocks straddle every edge
    blocks = LAYOUTS[layout](shape)
    shape = blocks[0].shape
    reference = whole(int(np.prod(shape))).view(shape)
    covered = torch.zeros(shape, dtype=torch.int32)
    for block in blocks:
        assert torch.equal(bits(block_init(block)), bits(reference[block.index()])), block
        covered[block.index()] += 1
    assert bool((covered == 1).all())  # the blocks tile the tensor: every element exactly once


def test_a_3d_expert_tensor_cut_on_dim_0_is_one_range():
    block = LocalBlock((8, 6, 5), (3, 0, 0), (3, 6, 5))
    assert list(block.flat_ranges()) == [(90, 180)]
    assert list(LocalBlock((8, 6, 5), (0, 2, 0), (2, 3, 5)).flat_ranges()) == [(10, 25), (40, 55)]


def tiny(**changes) -> ModelConfig:
    base = get_preset("tiny-moe").to_dict() | dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48)
    return ModelConfig(**(base | dict(vocab_size=301, num_hidden_layers=1, head_dim=16) | changes))


def test_an_hf_checkpoint_read_block_by_block_has_the_stored_bits(tmp_path):
    """Each parameter of a model read from safetensors one block at a time (here: a model built on
    meta, materialised, filled by `load_pretrained_into` with its parameters as plain tensors;
    the sharded case runs in tests/trainer/test_sharded_init.py) equals the saved model."""
    saved = build(tiny(), seed=3)
    save_pretrained(saved, tmp_path / "hf")
    model = build_meta(saved.config).to_empty(device="cpu")
    load_pretrained_into(model, tmp_path / "hf")
    for (name, a), (_, b) in zip(saved.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(bits(a), bits(b)), name
    other = build_meta(tiny(vocab_size=302)).to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"config\.json: vocab_size = 301, the model to load into has 302"):
        load_pretrained_into(other, tmp_path / "hf")


def test_a_tied_checkpoints_stored_head_is_checked_against_the_embedding(tmp_path):
    from safetensors.torch import load_file, save_file

    saved = build(tiny(tie_word_embeddings=True), seed=3)
    save_pretrained(saved, tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.clone()}, file, metadata={"format": "pt"})
    model = build_meta(saved.config).to_empty(device="cpu")
    load_pretrained_into(model, tmp_path / "hf")  # an equal stored head is accepted
    assert torch.equal(bits(model.embed_tokens.weight), bits(saved.embed_tokens.weight))
    head = embed.clone()
    head[-1, -1] = torch.nextafter(head[-1, -1], torch.tensor(1.0))  # its last element, one ulp off
    save_file({**tensors, "lm_head.weight": head}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_pretrained_into(model, tmp_path / "hf")
