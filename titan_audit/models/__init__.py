"""models/: the one decoder used for training, prefill and decode (dense and MoE), HF-compatible.

    model = models.build("tiny-dense", seed=0)              # or a ModelConfig
    logits = model(tokens)                                   # [B, T] -> [B, T, V]
    logits = model(tokens, doc_ids=doc_ids)                  # packed documents
    cache = models.PagedKVCache(model.config, num_blocks=64, block_size=16)
    cache.add("a"); logits = model(prompt, cache=cache.batch(["a"]))   # prefill, then decode
    lp = models.token_logprobs(logits[:, :-1], tokens[:, 1:])
    models.save_pretrained(model, "ckpt/"); model = models.from_pretrained("ckpt/")

Guarantees (each module's doc says more): in batch-invariant mode a token's logits are bitwise
independent of the batch, of padding/packing and of whether they come from a full forward, a
chunked prefill or a KV-cache decode (contiguous or paged); HF Qwen3 / Qwen3-MoE / Llama
checkpoints load with logits matching transformers in float32 tolerance; init is a pure function
of (config, seed).
"""

from titan_audit.models.build import build, resolve_config
from titan_audit.models.config import ModelConfig
from titan_audit.models.hf import check_pretrained, from_pretrained, load_config, save_pretrained, to_hf_state_dict
from titan_audit.models.kv_cache import ContiguousKVCache, PagedKVCache
from titan_audit.models.logprobs import token_logprobs
from titan_audit.models.presets import PRESETS, get_preset
from titan_audit.models.transformer import Transformer

__all__ = [
    "PRESETS",
    "ContiguousKVCache",
    "ModelConfig",
    "PagedKVCache",
    "Transformer",
    "build",
    "check_pretrained",
    "from_pretrained",
    "get_preset",
    "load_config",
    "resolve_config",
    "save_pretrained",
    "to_hf_state_dict",
    "token_logprobs",
]
