"""The RL job's spec (`RLJob`): its config and recipes, its checks, what its check hands the loop.

Guarantees: every check `rl_train` makes before it computes runs here, without compute and without
writing (ValueError naming the key): W against the prompt blocks, tensor parallelism, the device
and backend, the vLLM generator's limits, the init, the task (tokenizer against the model, the
user's prompts and rewards, prompts against the context), the run directory (trainer/checks.py),
and on a resume the --init and the task's inputs against those the run started with. The launcher
runs `check_run` before torchrun starts, rank 0 again inside the run, where the task it built is
handed to the loop (`run.checked`) and its inputs go to the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_audit.rl.config import RECIPES, RESUME_MUTABLE_KEYS, RLConfig
from titan_audit.rl.rollout_schedule import check_prompts
from titan_audit.rl.user_task import build_task, input_differences
from titan_audit.trainer.checks import check_backend
from titan_audit.trainer.init import check_init, init_record
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions
from titan_audit.trainer.run_dir import read_manifest
from titan_audit.trainer.tensor_parallel import check_tensor_parallel


class RLJob(JobSpec):
    """`titan-audit rl`: the loop is rl/loop.py's `rl_train` (bound there: `RL_JOB`)."""

    kind = "rl"
    config_class = RLConfig
    recipes = RECIPES
    recipe_word = "RL recipe"
    rank_entry = "titan_audit.rl.rank_entry"
    resume_mutable = RESUME_MUTABLE_KEYS
    loop_options = ("init", "resume", "overwrite", "quiet", "audit_verified")

    def check_options(self, options: LaunchOptions) -> None:
        if options.until is not None or options.stop_at is not None:
            raise ValueError("an RL run stops at its config's steps (--until and a stop step are train's)")

    def check_request(self, config: RLConfig, world_size: int, options: LaunchOptions) -> Any:
        return check_inputs(config, world_size, options.init)

    def check_resume(self, config: RLConfig, out: Path, handed: Any) -> None:
        """The task's inputs (prompts file, reward modules, tokenizer) are those the run started with."""
        changed = input_differences(read_manifest(out).get("task_inputs"), handed.inputs)
        if changed:
            raise ValueError(f"{out}: {'; '.join(changed)} since the run started; restore it or start a new run")

    def prepare(self, config: RLConfig, out: Path) -> None:
        """Nothing: an RL run's inputs are its task's, checked and recorded, not copied."""

    def manifest_extra(self, config: RLConfig, options: LaunchOptions, checked: Any) -> dict[str, Any]:
        inputs = checked.inputs
        return {"init": init_record(options.init), **({"task_inputs": inputs} if inputs is not None else {})}


def check_inputs(config: RLConfig, world_size: int, init: str | os.PathLike | None = None):
    """Every check of the RL request that needs no compute (ValueError naming the key); the task."""
    config.check_world_size(world_size)
    check_tensor_parallel(config)
    check_backend(config)
    if config.generator == "vllm":
        if config.parallel.device != "cpu":
            raise ValueError(
                f"generator = 'vllm' runs vLLM's CPU engine (a CUDA engine for our attention backend is not "
                f"built) and parallel.device = {config.parallel.device!r}; use generator = 'builtin' on cuda"
            )
        from titan_audit.rl import vllm as rl_vllm

        rl_vllm.require()  # one line: how to install the extra
        if world_size > 1 or config.parallel.mode == "fsdp":
            raise ValueError(
                f"generator = 'vllm' runs on one rank (its in-process engine owns torch.distributed); "
                f"got world size {world_size}, parallel.mode = {config.parallel.mode!r}: use --nproc 1 and "
                f"parallel.mode = 'dp', or generator = 'builtin'"
            )
    check_init(init, config.model)  # files and shape (the launcher gave the config the init's shape)
    task = build_task(config)  # the tokenizer against the model, the user's prompts and rewards
    check_prompts(config, task.prompts(1))
    return task
