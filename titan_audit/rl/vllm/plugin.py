"""The `vllm.general_plugins` entry point (pyproject.toml): runs in every vLLM process.

vLLM calls `register()` in the process that creates the engine and in each of its engine-core
and worker processes (with the default multi-process engine, only an entry point reaches those).
It:
- registers our architecture (`model.ARCHITECTURE` -> `model.TitanForCausalLM`, lazily by name,
  so vLLM's registry imports it only when a checkpoint asks for it);
- when `TITAN_AUDIT_VLLM_BATCH_INVARIANT=1` (VllmGenerator sets it for a BI engine), installs the
  batch-invariant ops process-wide (`batch_invariant.enable()`) in every vLLM process other than
  the one that started the engine (`TITAN_AUDIT_VLLM_PARENT_PID`): that process keeps its own
  mode (the model and the sampler enter BI mode around their work themselves, so an in-process
  engine never leaves the caller's process switched). There it also sets the gemm order the
  engine's starter ran in (`TITAN_AUDIT_VLLM_GEMM_ORDER`, batch_invariant/order.py), so the
  workers' gemms sum in the run's `determinism.bi_kernels` order.
Idempotent; importing this module does not import vLLM.
"""

from __future__ import annotations

import os

BATCH_INVARIANT_ENV = "TITAN_AUDIT_VLLM_BATCH_INVARIANT"
PARENT_PID_ENV = "TITAN_AUDIT_VLLM_PARENT_PID"
GEMM_ORDER_ENV = "TITAN_AUDIT_VLLM_GEMM_ORDER"


def register() -> None:
    from vllm import ModelRegistry

    from titan_audit.rl.vllm.model import ARCHITECTURE

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "titan_audit.rl.vllm.model:TitanForCausalLM")
    if os.environ.get(BATCH_INVARIANT_ENV) == "1" and os.environ.get(PARENT_PID_ENV) != str(os.getpid()):
        from titan_audit import batch_invariant

        order = os.environ.get(GEMM_ORDER_ENV)
        if order is not None:
            batch_invariant.set_gemm_order(order)
        batch_invariant.enable()
