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
microbatch, synthetic (verifiable-task corpora as Parquet).
"""

from titan_audit.data.batches import BatchSpec, GlobalBatches
from titan_audit.data.loader import ElasticLoader, LoaderConfig
from titan_audit.data.manifest import FileEntry, SourceManifest, check_unchanged
from titan_audit.data.microbatch import Microbatch, concat
from titan_audit.data.packing import BestFitPacker, ConcatPacker, make_packer
from titan_audit.data.permutation import FeistelPermutation
from titan_audit.data.plan import BatchPlan
from titan_audit.data.prepare import PrepareConfig, prepare
from titan_audit.data.sources import open_text_source
from titan_audit.data.state import LoaderState
from titan_audit.data.synthetic import SyntheticConfig, TaskRecord, is_correct, make_record, solve, write_synthetic_parquet
from titan_audit.data.token_store import TokenStore, store_manifest, write_token_store
from titan_audit.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerSpec

__all__ = [
    "BatchPlan", "BatchSpec", "BestFitPacker", "ByteTokenizer", "ConcatPacker", "ElasticLoader", "FeistelPermutation",
    "FileEntry", "GlobalBatches", "HFTokenizer", "LoaderConfig", "LoaderState", "Microbatch", "PrepareConfig",
    "SourceManifest", "SyntheticConfig", "TaskRecord", "TokenStore", "TokenizerSpec", "check_unchanged", "concat",
    "is_correct", "make_packer", "make_record", "open_text_source", "prepare", "solve", "store_manifest",
    "write_synthetic_parquet", "write_token_store",
]  # fmt: skip
