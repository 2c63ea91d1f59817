"""data/: the elastically deterministic loader (same global batches at any world size, O(1) resume).

    prepare(PrepareConfig(sources=("corpus.parquet",), out="corpus.zarr"))     # text -> token store
    loader = ElasticLoader(LoaderConfig(store="corpus.zarr", seq_len=512, global_batch_size=64,
                                        microbatch_size=4), rank=r, world_size=W, state=saved)
    for mb in loader: ...                                                      # Microbatch
    saved = loader.state()                                                     # LoaderState

Pieces, one concern per module: sources (Parquet/JSONL), manifest (what the data was), tokenizer
(byte-level or HF tokenizer.json), token_store (zarr v3), prepare (text -> store, parallel),
packing (concat / best_fit), permutation (Feistel, O(1) state), plan (global batch -> ranks),
batches (pure (epoch, step, microbatch) -> arrays), prefetch (ordered workers), loader, state,
microbatch, synthetic (verifiable-task corpora as Parquet), builtin (synthetic corpus + store),
textio (UTF-8 / JSON input whose errors name the file and line).
"""

import importlib
from typing import TYPE_CHECKING, Any

# Torch-free modules are imported now (`prepare` must be bound to the function, not its module).
from titan_audit.data.manifest import FileEntry, SourceManifest, check_unchanged
from titan_audit.data.prepare import PrepareConfig, prepare
from titan_audit.data.sources import open_text_source
from titan_audit.data.token_store import TokenStore, store_manifest, write_token_store
from titan_audit.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerSpec

# Names are imported on first use, so that a worker process that only tokenizes (prepare.py)
# does not import torch.
_EXPORTS = {
    "BuiltinData": "titan_audit.data.builtin",
    "prepare_synthetic": "titan_audit.data.builtin",
    "BatchPlan": "titan_audit.data.plan",
    "BatchSpec": "titan_audit.data.batches",
    "BestFitPacker": "titan_audit.data.packing",
    "ByteTokenizer": "titan_audit.data.tokenizer",
    "ConcatPacker": "titan_audit.data.packing",
    "ElasticLoader": "titan_audit.data.loader",
    "FeistelPermutation": "titan_audit.data.permutation",
    "FileEntry": "titan_audit.data.manifest",
    "GlobalBatches": "titan_audit.data.batches",
    "HFTokenizer": "titan_audit.data.tokenizer",
    "LoaderConfig": "titan_audit.data.loader",
    "LoaderState": "titan_audit.data.state",
    "Microbatch": "titan_audit.data.microbatch",
    "PrepareConfig": "titan_audit.data.prepare",
    "SourceManifest": "titan_audit.data.manifest",
    "SyntheticConfig": "titan_audit.data.synthetic",
    "TaskRecord": "titan_audit.data.synthetic",
    "TokenStore": "titan_audit.data.token_store",
    "TokenizerSpec": "titan_audit.data.tokenizer",
    "check_unchanged": "titan_audit.data.manifest",
    "concat": "titan_audit.data.microbatch",
    "is_correct": "titan_audit.data.synthetic",
    "make_packer": "titan_audit.data.packing",
    "make_record": "titan_audit.data.synthetic",
    "open_text_source": "titan_audit.data.sources",
    "prepare": "titan_audit.data.prepare",
    "solve": "titan_audit.data.synthetic",
    "store_manifest": "titan_audit.data.token_store",
    "write_synthetic_parquet": "titan_audit.data.synthetic",
    "write_token_store": "titan_audit.data.token_store",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_audit.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # static tools see the real imports
    from titan_audit.data.batches import BatchSpec, GlobalBatches
    from titan_audit.data.builtin import BuiltinData, prepare_synthetic
    from titan_audit.data.loader import ElasticLoader, LoaderConfig
    from titan_audit.data.manifest import FileEntry, SourceManifest, check_unchanged
    from titan_audit.data.microbatch import Microbatch, concat
    from titan_audit.data.packing import BestFitPacker, ConcatPacker, make_packer
    from titan_audit.data.permutation import FeistelPermutation
    from titan_audit.data.plan import BatchPlan
    from titan_audit.data.prepare import PrepareConfig, prepare
    from titan_audit.data.sources import open_text_source
    from titan_audit.data.state import LoaderState
    from titan_audit.data.synthetic import (
        SyntheticConfig,
        TaskRecord,
        is_correct,
        make_record,
        solve,
        write_synthetic_parquet,
    )
    from titan_audit.data.token_store import TokenStore, store_manifest, write_token_store
    from titan_audit.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerSpec

__all__ = sorted(_EXPORTS)
