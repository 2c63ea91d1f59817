"""`titan-audit data`: prepare token stores, make synthetic corpora, inspect stores and batch plans.

Thin commands over titan_audit.data; bad input exits 2 with a one-line error (AuditGroup).
"""

from __future__ import annotations

import click

from titan_audit.cli.errors import AuditGroup
from titan_audit.cli.output import print_json, print_mapping


@click.group(cls=AuditGroup, short_help="Tokenize, synthesize and inspect training data.")
def data() -> None:
    """Data for the elastically deterministic loader (token stores, batch plans)."""


@data.command(short_help="Tokenize Parquet/JSONL files into a zarr token store.")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Token store directory to create.")
@click.option("--text-column", default="text", show_default=True, help="Parquet column / JSONL key holding the text.")
@click.option(
    "--tokenizer", "tokenizer_path", type=click.Path(), default=None, help="HF tokenizer.json (default: byte-level)."
)
@click.option("--eos-token", default=None, help="End-of-text token of the HF tokenizer (default: detected).")
@click.option(
    "--workers", default=0, show_default=True, help="Tokenizer processes (0 = this process); bytes do not depend on it."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def prepare(
    sources: tuple[str, ...],
    out: str,
    text_column: str,
    tokenizer_path: str | None,
    eos_token: str | None,
    workers: int,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Tokenize SOURCES (files or directories) once into the token store OUT."""
    from dataclasses import asdict

    from titan_audit.data import PrepareConfig, TokenizerSpec, TokenStore
    from titan_audit.data import prepare as run_prepare

    config = PrepareConfig(
        sources=sources,
        out=out,
        text_column=text_column,
        tokenizer=TokenizerSpec(tokenizer_path, eos_token),
        workers=workers,
        overwrite=overwrite,
    )
    info = asdict(run_prepare(config, progress=not as_json))
    info["manifest_digest"] = TokenStore(out).manifest().digest()
    print_json(info) if as_json else print_mapping(f"token store {out}", info)


@data.command(short_help="Write a synthetic verifiable-task corpus as Parquet.")
@click.argument("out", type=click.Path())
@click.option("--num", "num_records", default=10000, show_default=True, help="Records to generate.")
@click.option("--seed", default=0, show_default=True)
@click.option("--task", "tasks", multiple=True, help="arithmetic, reversal, sorting (repeatable; default all).")
@click.option("--row-group-size", default=1024, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
def synth(out: str, num_records: int, seed: int, tasks: tuple[str, ...], row_group_size: int, overwrite: bool) -> None:
    """Generate OUT (Parquet: id, task, prompt, answer, text) from a seed."""
    from titan_audit.data import SyntheticConfig, write_synthetic_parquet
    from titan_audit.data.synthetic import TASKS

    config = SyntheticConfig(num_records, seed, tasks or TASKS, row_group_size)
    write_synthetic_parquet(out, config, overwrite=overwrite)
    click.echo(f"wrote {num_records} records to {out}")


@data.command(short_help="Describe a token store and its source manifest.")
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def inspect(store: str, as_json: bool) -> None:
    """Print a token store's facts, manifest digest and origin files."""
    from dataclasses import asdict

    from titan_audit.data import TokenStore

    opened = TokenStore(store)
    manifest = opened.manifest()
    lengths = opened.doc_lengths()
    info = {
        **asdict(opened.info),
        "manifest_digest": manifest.digest(),
        "files": len(manifest.entries),
        "doc_len_min": int(lengths.min()),
        "doc_len_mean": float(lengths.mean()),
        "doc_len_max": int(lengths.max()),
        "origin": [e.to_dict() for e in manifest.origin.entries] if manifest.origin else None,
    }
    if as_json:
        print_json(info)
        return
    origin = info.pop("origin")
    print_mapping(f"token store {store}", info)
    for entry in origin or []:
        click.echo(f"source {entry['name']}: {entry['rows']} rows, {entry['size']} bytes, xxh3 {entry['hash']}")


@data.command(short_help="Show the global batch plan and the hashes of one step.")
@click.argument("store", type=click.Path())
@click.option("--seq-len", type=int, required=True)
@click.option("--global-batch", type=int, required=True, help="Sequences per step (B).")
@click.option("--microbatch", type=int, required=True, help="Sequences per virtual microbatch (M).")
@click.option("--seed", default=0, show_default=True)
@click.option("--packing", type=click.Choice(["concat", "best_fit"]), default="concat", show_default=True)
@click.option("--world-size", default=1, show_default=True, help="Checked to divide V; shows each rank's block.")
@click.option("--step", "global_step", default=0, show_default=True, help="Global step whose microbatches are hashed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def plan(
    store: str,
    seq_len: int,
    global_batch: int,
    microbatch: int,
    seed: int,
    packing: str,
    world_size: int,
    global_step: int,
    as_json: bool,
) -> None:
    """Print V, steps per epoch, each rank's microbatches and the fingerprints of a step."""
    from titan_audit.data import BatchSpec, GlobalBatches, Microbatch, TokenStore

    batches = GlobalBatches(TokenStore(store), BatchSpec(seq_len, global_batch, microbatch, seed, packing))
    epoch, step = batches.position(global_step)
    total = batches.step_loss_tokens(epoch, step)
    hashes = []
    for index in range(batches.num_microbatches):
        mb = Microbatch.from_arrays(
            epoch, step, index, batches.num_microbatches, total, batches.microbatch_arrays(epoch, step, index)
        )
        hashes.append(mb.fingerprints())
    out = {
        "num_sequences": batches.num_sequences,
        "steps_per_epoch": batches.steps_per_epoch,
        "num_microbatches": batches.num_microbatches,
        "epoch": epoch,
        "step": step,
        "global_loss_tokens": total,
        "ranks": {r: list(batches.plan.rank_microbatches(r, world_size)) for r in range(world_size)},
        "microbatch_token_hashes": [h["tokens"] for h in hashes],
    }
    if as_json:
        out["microbatch_hashes"] = hashes
        print_json(out)
        return
    print_mapping(f"batch plan {store}", {k: v for k, v in out.items() if k != "microbatch_token_hashes"})
    for index, digest in enumerate(out["microbatch_token_hashes"]):
        click.echo(f"microbatch {index}: tokens {digest}")
