"""The train job's spec (`TrainJob`): its config and recipes, its checks, its files and manifest keys.

Guarantees: every check `train` makes before it computes runs here, without compute and without
writing (ValueError naming the key or path): W against the microbatches, tensor parallelism, the
device and backend, the init (files, shape), the data against the model, the run directory
(trainer/checks.py) and on a resume that an --init given names the run's own. The launcher runs
`check_run` before torchrun starts, rank 0 again inside the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_audit.data import SyntheticConfig, prepare_synthetic
from titan_audit.trainer.checks import check_backend
from titan_audit.trainer.config import RECIPES, RESUME_MUTABLE_KEYS, TrainConfig
from titan_audit.trainer.init import check_init, init_record
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions
from titan_audit.trainer.tensor_parallel import check_tensor_parallel
from titan_audit.trainer.until import Stopper, parse_until


class TrainJob(JobSpec):
    """`titan-audit train`: the loop is trainer/train.py's `train` (bound there: `TRAIN_JOB`)."""

    kind = "train"
    config_class = TrainConfig
    recipes = RECIPES
    recipe_word = "recipe"
    rank_entry = "titan_audit.trainer.rank_entry"
    resume_mutable = RESUME_MUTABLE_KEYS
    loop_options = ("resume", "overwrite", "stop_at", "quiet", "init", "until", "audit_verified")

    def check_options(self, options: LaunchOptions) -> None:
        if options.until is not None:
            parse_until(options.until)

    def check_request(self, config: TrainConfig, world_size: int, options: LaunchOptions) -> None:
        check_inputs(config, world_size, options.init)

    def check_resume(self, config: TrainConfig, out: Path, handed: Any) -> None:
        """Nothing beyond the run directory's checks: train's inputs are its config's."""

    def prepare(self, config: TrainConfig, out: Path) -> None:
        """The built-in synthetic corpus, prepared once into RUN/data/."""
        if config.data.store is None and not (out / "data" / "tasks.zarr").is_dir():
            synthetic = SyntheticConfig(num_records=config.data.synthetic_records, seed=config.data.synthetic_seed)
            prepare_synthetic(out / "data", synthetic, overwrite=True)

    def manifest_extra(self, config: TrainConfig, options: LaunchOptions, checked: Any) -> dict[str, Any]:
        init = {"init": init_record(options.init)} if options.init is not None else {}
        return init | Stopper(options.until).record()


def check_inputs(config: TrainConfig, world_size: int, init=None) -> None:
    """The request's own checks (ValueError naming the keys): W vs V, the backend, the init (files, shape), the data."""
    config.check_world_size(world_size)
    check_tensor_parallel(config)
    check_backend(config)
    check_init(init, config.model)
    check_data(config)


def check_data(config: TrainConfig) -> None:
    """The data against the model, before step 1 (ValueError naming the keys): the packed
    positions lie in [0, data.seq_len) (packing.py cuts longer documents into pieces), so
    data.seq_len must not exceed the model's max_position_embeddings; every token id the store
    can hold (its tokenizer's vocab_size, EOS and PAD ids) must be below the model's vocab_size; a
    token store must hold one global batch of packed sequences at least."""
    from titan_audit.data import ByteTokenizer, TokenStore

    model = config.model.model_config()
    where = f"model.preset {config.model.preset!r}" + (" with model.overrides" if config.model.overrides else "")
    if config.data.seq_len > model.max_position_embeddings:
        raise ValueError(
            f"data.seq_len = {config.data.seq_len} exceeds max_position_embeddings = "
            f"{model.max_position_embeddings} of {where}"
        )
    if config.data.store is None:
        tok = ByteTokenizer()
        name, vocab, eos, pad = "the synthetic corpus (byte tokenizer)", tok.vocab_size, tok.eos_id, tok.pad_id
    else:
        try:
            info = TokenStore(config.data.store).info
        except ValueError as error:
            raise ValueError(f"data.store: {error}") from None
        name, vocab, eos, pad = (
            f"data.store {config.data.store} (tokenizer {info.tokenizer})",
            info.vocab_size,
            info.eos_id,
            info.pad_id,
        )
    if max(vocab, eos + 1, pad + 1) > model.vocab_size:
        raise ValueError(
            f"{name} has vocab_size {vocab} (eos_id {eos}, pad_id {pad}) but vocab_size = "
            f"{model.vocab_size} of {where}: token ids would fall outside the embedding"
        )
    if config.data.store is not None:  # the store against the plan: one global batch at least
        from titan_audit.data import BatchSpec, GlobalBatches

        d = config.data
        spec = BatchSpec(d.seq_len, d.global_batch_size, d.microbatch_size, seed=config.seed, packing=d.packing)
        try:
            GlobalBatches(TokenStore(d.store), spec)
        except ValueError as error:
            raise ValueError(f"data.store: {error}") from None
