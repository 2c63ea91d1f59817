"""Options several commands share, spelled once."""

from __future__ import annotations

import click

from titan_audit.trainer.run_dir import OVERWRITE_MODES


def overwrite_option(what: str = "a run already in --out"):
    """`--overwrite` (move the old run aside to OUT.replaced-<time>, said in the log) or
    `--overwrite=delete` (remove it); the value reaches the library as "move" / "delete" / False."""
    return click.option(
        "--overwrite",
        type=click.Choice(OVERWRITE_MODES),
        is_flag=False,
        flag_value="move",
        default=None,
        callback=lambda ctx, param, value: value or False,
        help=f"Replace {what}: moved aside to OUT.replaced-<time> (the log says where); =delete removes it.",
    )


def multinode_options(fn):
    """`--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`: this node of a multi-node launch
    through torchrun's c10d rendezvous (trainer/launch/rendezvous.py `Rendezvous`); the command receives
    them as `nnodes`, `node_rank`, `rdzv_endpoint`."""
    for option in reversed(
        (
            click.option(
                "--nnodes", type=int, default=None, help="Nodes of a multi-node launch (each with --nproc ranks)."
            ),
            click.option("--node-rank", type=int, default=None, help="This node's index in [0, --nnodes); default 0."),
            click.option(
                "--rdzv-endpoint",
                default=None,
                metavar="HOST:PORT",
                help="Node 0's address for torchrun's c10d rendezvous (node 0 hosts it).",
            ),
        )
    ):
        fn = option(fn)
    return fn


DEVICES = ("cpu", "cuda")  # trainer/config.py's parallel.device (spelled here: no torch import for --help)


def device_option(
    help: str = "Where the ranks compute: cpu, or cuda (GPU LOCAL_RANK per rank); "
    "the same as --set parallel.device=...; default: the config's (cpu).",
):
    """`--device cpu|cuda`: the same as `--set parallel.device=...` given after the --set options
    (`device_override`); the command receives `device` (None: the config's)."""
    return click.option("--device", type=click.Choice(DEVICES), default=None, help=help)


def device_override(device: str | None) -> list[str]:
    """The `--set` override `--device` stands for (none without it)."""
    return [] if device is None else [f"parallel.device={device}"]


class _Nproc(click.ParamType):
    """A rank count N >= 1, or "auto" (trainer/launch/rendezvous.py `resolve_nproc` picks W from the cores)."""

    name = "N|auto"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number or 'auto'", param, ctx)


def nproc_option():
    """`--nproc N|auto`: N local ranks through torchrun; auto: as many as the cores allow for the
    config (the trajectory is the same at every W); the command receives `nproc`."""
    return click.option(
        "--nproc",
        type=_Nproc(),
        metavar="N|auto",
        default=None,
        help="Launch N local ranks through torchrun; 'auto': the most the usable cores and the config allow.",
    )
