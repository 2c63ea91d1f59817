"""rl/vllm/: the vLLM generator -- our models/ transformer running inside real vLLM (guarantee G4).

    from titan_audit.rl import vllm as rl_vllm
    if rl_vllm.available():
        gen = rl_vllm.VllmGenerator(model, rl_vllm.VllmGeneratorConfig(batch_invariant=True))
        samples = gen.generate(requests, params)            # the Generator contract, rl/generator.py

Parts (each module's docstring says what it guarantees):
- `model.py`: `TitanForCausalLM`, an out-of-tree vLLM architecture that runs the models/ modules
  (embedding, norms, attention projections, RoPE table, MLP / MoE, LM head) over vLLM's flat
  `[num_tokens]` batches; checkpoints written by `models.save_pretrained` load unchanged;
- `attention.py`: our attention backend over vLLM's paged KV cache: it writes K/V into the
  cache and runs `batch_invariant.attention` per request over that request's keys in absolute
  position order, so prefill, chunked prefill, prefix-cache hits and decode give the trainer's bits;
- `sampler.py`: a vLLM logits processor doing rl/sampling.py's keyed draw and reporting our
  log-prob of the drawn token through vLLM's log-prob output;
- `plugin.py`: the `vllm.general_plugins` entry point (every vLLM process): registers the
  architecture and, when `TITAN_AUDIT_VLLM_BATCH_INVARIANT=1`, installs the BI ops;
- `generator.py`: `VllmGenerator` (keyed sampling, in-place weight sync + fingerprint check,
  prefix-cache reset).

Importing this package sends vLLM's log to stderr at level ERROR (`VLLM_LOGGING_STREAM`,
`VLLM_LOGGING_LEVEL`, only where unset), so `--json` output stays clean. It imports without vLLM;
`available()` says whether the `vllm` extra is installed and `require()` raises a one-line
ValueError saying how to install it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

# vLLM logs INFO lines to stdout by default, which would break `--json` output: send its log to
# stderr and keep errors only, unless the user set these variables.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

INSTALL_HINT = (
    "the vLLM generator needs the `vllm` extra: run `make setup` (it installs it), or "
    "`pip install -e '.[vllm]'` and then `pip uninstall -y torchvision torchaudio torchcodec`"
)

if TYPE_CHECKING:
    from titan_audit.rl.vllm.generator import VllmGenerator, VllmGeneratorConfig


def available() -> bool:
    """True iff the `vllm` package can be imported here (checked without importing it: cheap)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def require() -> None:
    """ValueError with the install hint (one line) unless vLLM is installed and imports."""
    if not available():
        raise ValueError(INSTALL_HINT)
    try:
        import vllm  # noqa: F401
    except Exception as error:  # a broken install (e.g. CUDA torchvision beside the CPU torch)
        raise ValueError(
            f"vLLM is installed but does not import ({type(error).__name__}: {error}); {INSTALL_HINT}"
        ) from None


def __getattr__(name: str) -> Any:
    if name in ("VllmGenerator", "VllmGeneratorConfig"):
        require()
        from titan_audit.rl.vllm import generator

        return getattr(generator, name)
    raise AttributeError(name)


__all__ = ["INSTALL_HINT", "VllmGenerator", "VllmGeneratorConfig", "available", "require"]
