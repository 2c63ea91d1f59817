"""A model materialised where it lives (trainer/materialize.py): laid out on the meta device (TP,
then FSDP2), allocated with `to_empty`, each rank filling only its pieces, from the seed, from an
HF directory (safetensors slices) or from a run's checkpoint (DCP, no optimizer). Gathered, the
parameters are bit for bit those of the whole model (`build`, `from_pretrained`, the saved
model), at W = 4: FSDP2 (uneven dim-0 chunks: 1002 vocabulary rows, 6 experts, one rank holding
none), FSDP2 x TP on a (2, 2) mesh (TP Shard(0) and Shard(1) pieces cut again on dim 0) and DP x
TP. (Block arithmetic at W = 3 is tests/models/test_sharded_init.py's.) Memory: during the seed
init at W = 4 no allocation reaches the size of the biggest parameter and the live bytes stay
under half the model's; the control, the whole-model build, reaches both.
Controls the test constructs: another seed's sharded init differs from the whole model."""

from __future__ import annotations

import gc

import pytest
import torch
from distributed import run_ranks
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import ProfilerActivity, profile

from titan_audit.models import build, from_pretrained, save_pretrained
from titan_audit.models.init import init_weights
from titan_audit.trainer.checkpoint import Checkpointer
from titan_audit.trainer.config import from_dict, load_config, to_dict
from titan_audit.trainer.init import load_checkpoint, load_init
from titan_audit.trainer.materialize import laid_out

pytestmark = pytest.mark.slow  # one 4-process gloo group: ~30 s on the 2 shared cores, mostly its start-up

W = 4  # one process group for every case: the suite pays one start-up
# rows % 4 != 0: 1002 vocabulary rows (chunks 251, 251, 251, 249), 6 experts (2, 2, 2, 0)
UNEVEN = ["model.overrides.vocab_size=1002", "model.overrides.num_hidden_layers=2"]
CASES = {  # name: (tp, recipe, config overrides)
    "fsdp-w4": (1, "tiny-dense", ["parallel.mode=fsdp", *UNEVEN]),
    "fsdp-w4-moe": (1, "tiny-moe", ["parallel.mode=fsdp", "model.overrides.num_experts=6", *UNEVEN]),
    "fsdp-tp-22": (2, "tiny-dense", ["parallel.mode=fsdp", "parallel.tp=2"]),
    "dp-tp-22": (2, "tiny-dense", ["parallel.tp=2"]),
}


def config_of(name: str):
    _, recipe, overrides = CASES[name]
    return load_config(recipe, overrides)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def differing(model: torch.nn.Module, reference: dict[str, torch.Tensor], *, gather: bool = False) -> list[str]:
    """Names whose parameter differs from the reference's bits. gather: each DTensor gathered
    whole (`full_tensor`, collective); otherwise its local piece compared with torch's own cut of
    the reference (`distribute_tensor` with the parameter's mesh and placements and no source
    rank: no communication)."""
    out = []
    for name, param in model.named_parameters():
        mine, expected = param, reference[name]
        if isinstance(param, DTensor) and gather:
            mine = param.full_tensor()
        elif isinstance(param, DTensor):
            mine = param.to_local()
            cut = distribute_tensor(expected.detach(), param.device_mesh, param.placements, src_data_rank=None)
            expected = cut.to_local()
        if not torch.equal(bits(mine), bits(expected)):
            out.append(name)
    return out


def allocations(fn) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of the CPU allocator while fn runs. The garbage
    collector is run before and paused during it: a cycle freed in the window (FSDP2's modules
    hold some) would count as a negative allocation."""
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        gc.enable()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = largest = 0
    for _, nbytes in events:
        live += nbytes
        peak, largest = max(peak, live), max(largest, nbytes)
    return peak, largest


def mesh_of(rank: int, world_size: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    from titan_audit.trainer.mesh import Mesh

    device_mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    return Mesh("cpu", world_size, rank, tp, device_mesh)


def materialised(config, mesh, fill) -> torch.nn.Module:
    model, _ = laid_out(config, mesh)
    model.to_empty(device="cpu")
    fill(model)
    return model


def _rank(rank: int, world_size: int, names: list[str], sources: dict) -> dict:
    return {name: _case(rank, world_size, name, sources.get(name)) for name in names}


def _case(rank: int, world_size: int, name: str, sources: tuple[str, str] | None) -> dict:
    config = from_dict(to_dict(config_of(name)))
    mesh = mesh_of(rank, world_size, CASES[name][0])
    shape = config.model.model_config()
    whole = dict(build(shape, seed=5).named_parameters())
    seeded = materialised(config, mesh, lambda m: init_weights(m, 5, shape.initializer_range))
    out = {"seed": differing(seeded, whole, gather=True), "seed-pieces": differing(seeded, whole)}
    out["held"] = [n for n, p in seeded.named_parameters() if (p.to_local() if isinstance(p, DTensor) else p).numel()]
    out["control"] = differing(materialised(config, mesh, lambda m: init_weights(m, 6, shape.initializer_range)), whole)
    if sources is not None:
        hf, run = sources
        from_hf = materialised(config, mesh, lambda m: load_init(m, hf))
        out["hf"] = differing(from_hf, dict(from_pretrained(hf, dtype=torch.float32).named_parameters()))
        from_run = materialised(config, mesh, lambda m: load_checkpoint(run, 1, m))
        out["run"] = differing(from_run, dict(build(shape, seed=11).named_parameters()))
    if name == "fsdp-w4":
        out["sizes"] = (max(p.nbytes for p in whole.values()), sum(p.nbytes for p in whole.values()))
        out["sharded"] = allocations(lambda: materialised(config, mesh, lambda m: init_weights(m, 5, 0.02)))
        out["whole"] = allocations(lambda: build(shape, seed=5))
    return out


def _sources(root, names: list[str]) -> dict:
    """Per case: an HF directory of seed 3's model and a run directory whose step-1 checkpoint holds
    seed 11's model with an AdamW state (what a run init must not rebuild), both written at W = 1."""
    out = {}
    for name in names:
        shape = config_of(name).model.model_config()
        hf = save_pretrained(build(shape, seed=3), root / name / "hf")
        model = build(shape, seed=11)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # lr 0: the state exists, the weights are seed 11's
        Checkpointer(root / name / "run").save(1, model, optimizer, {"step": 1})
        out[name] = (str(hf), str(root / name / "run"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharded-init")
    ranks = run_ranks(_rank, W, args=(sorted(CASES), _sources(root, ["fsdp-w4-moe", "fsdp-tp-22"])))
    return {name: [r[name] for r in ranks] for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_sharded_seed_init_is_the_whole_models(results, name):
    for rank, result in enumerate(results[name]):
        assert result["seed"] == [] and result["seed-pieces"] == [], (rank, result["seed"][:3])
        # control: another seed's pieces differ in every parameter the rank holds a piece of
        # (6 experts at W = 4: rank 3 holds none), but the norms (all ones)
        assert result["control"] == [n for n in result["held"] if "norm" not in n], rank


@pytest.mark.parametrize("name", ["fsdp-w4-moe", "fsdp-tp-22"])
def test_an_hf_init_and_a_run_init_load_into_the_shards_with_their_bits(results, name):
    for rank, result in enumerate(results[name]):
        assert result["hf"] == [] and result["run"] == [], (rank, result["hf"][:3], result["run"][:3])


def test_no_rank_allocates_a_full_parameter_while_it_materialises(results):
    for rank, result in enumerate(results["fsdp-w4"]):
        biggest, model_bytes = result["sizes"]
        peak, largest = result["sharded"]
        assert largest < biggest and peak < model_bytes // 2, (rank, peak, largest, biggest, model_bytes)
        whole_peak, whole_largest = result["whole"]  # control: the whole build reaches both
        assert whole_largest >= biggest and whole_peak >= model_bytes, (rank, whole_peak, whole_largest)
