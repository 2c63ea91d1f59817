"""What a launch is: its typed options, and the job spec that says what differs between train and RL.

Guarantees: `LaunchOptions` travels whole from the launcher to every rank, in the launch file
beside the resolved config (`write_launch_file`), and is read back typed (`read_launch_file`: an
unknown or mistyped key, or a file of another job kind, is a ValueError naming it). A
`JobSpec` is the one place a job says its config class and recipes, its checks, what its run check
hands the loop and its loop; the launcher (start.py), the rank entry (rank.py) and the run
(trainer/run.py) call its methods and nothing else.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_audit.trainer import typed_config
from titan_audit.trainer.checks import RunChecked, check_run_dir
from titan_audit.trainer.init import check_resume_init


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How a run starts, as the CLI asked (every field reaches every rank unchanged)."""

    resume: bool = False  # continue the run in OUT from its latest checkpoint
    overwrite: bool | str = False  # replace the run in OUT: True (= "move" it aside) or "delete"
    init: str | None = None  # another run's directory or an HF model directory to start from
    stop_at: int | None = None  # the last step to run (default: the config's steps)
    quiet: bool = False  # no progress lines
    until: str | None = None  # a stop condition on a skill level (train only: trainer/until.py)
    # set by the launcher, not the CLI: the audit-log parts its resume check read and found intact
    # (audit/log.py LogCheck.verified), so rank 0's check and the writers skip them while unchanged
    audit_verified: dict[str, list[int | str]] | None = None

    def __post_init__(self) -> None:
        if self.init is not None and not isinstance(self.init, str):  # a path: the launch file holds text
            object.__setattr__(self, "init", os.fspath(self.init))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "launch options") -> LaunchOptions:
        return typed_config.build(cls, data, where)


class JobSpec(abc.ABC):
    """A kind of job (train, RL): what the launcher, the ranks and the run need to know of it.

    The loop (`loop`) is given at construction, by the loop's own module, which also builds its
    `Run` with the spec: so no module of the launcher imports a loop."""

    kind: str  # "train" | "rl": the manifest's kind, the crash points' prefix
    config_class: type  # TrainConfig | RLConfig
    recipes: dict[str, dict[str, Any]]  # the recipes a source may name
    recipe_word: str  # what errors call a recipe: "recipe" | "RL recipe"
    rank_entry: str  # the module torchrun runs on each rank (a `rank_entry.py` nothing imports)
    loop_options: tuple[str, ...]  # the LaunchOptions fields the loop takes as keyword arguments

    def __init__(self, loop: Callable[..., Any]) -> None:
        self.loop = loop

    @abc.abstractmethod
    def check_options(self, options: LaunchOptions) -> None:
        """The options on their own, before anything is read (ValueError)."""

    @abc.abstractmethod
    def check_request(self, config: Any, world_size: int, options: LaunchOptions) -> Any:
        """Every check of the request that needs neither compute nor the run directory (a node
        R > 0 of a multi-node launch makes these only); ValueError naming the key."""

    resume_mutable: frozenset[str] | tuple[str, ...]  # config keys a resume may change

    def check_run(self, config: Any, out: Path, world_size: int, options: LaunchOptions) -> RunChecked:
        """Everything the job checks before it computes: the request (`check_request`), the run
        directory (trainer/checks.py: resume compatibility, checkpoints, the audit log's tail less
        the parts `options.audit_verified` holds), and on a resume that an --init given names the
        run's own and the job's `check_resume`. The launcher runs it before torchrun, rank 0 again
        in `Run`; its `handed` (what `check_request` returned) is the loop's `run.checked`."""
        out = Path(out)
        handed = self.check_request(config, world_size, options)
        verified = check_run_dir(
            config,
            out,
            kind=self.kind,
            mutable=self.resume_mutable,
            resume=options.resume,
            overwrite=options.overwrite,
            known=options.audit_verified,
        )
        if options.resume:
            check_resume_init(out, options.init)
            self.check_resume(config, out, handed)
        return RunChecked(verified, handed)

    @abc.abstractmethod
    def check_resume(self, config: Any, out: Path, handed: Any) -> None:
        """A resume's checks of the job's own inputs, beyond the run directory's (ValueError)."""

    @abc.abstractmethod
    def prepare(self, config: Any, out: Path) -> None:
        """Rank 0, under the run's lock, before the manifest: the job's own files."""

    @abc.abstractmethod
    def manifest_extra(self, config: Any, options: LaunchOptions, checked: Any) -> dict[str, Any]:
        """The job's keys of a new run's manifest (`checked`: what `check_run` returned)."""

    def run(self, config: Any, out: str | os.PathLike, options: LaunchOptions) -> Any:
        """The loop on this process's rank of the current group."""
        return self.loop(config, out, **{name: getattr(options, name) for name in self.loop_options})

    def config_from_dict(self, data: dict[str, Any], where: str) -> Any:
        return typed_config.build(self.config_class, data, where)


def write_launch_file(path: Path, job: JobSpec, config: Any, options: LaunchOptions) -> None:
    """The launch file the ranks read: the job's kind, the resolved config and the options, whole."""
    data = {"kind": job.kind, "config": typed_config.to_dict(config), "options": options.to_dict()}
    path.write_text(json.dumps(data))


def read_launch_file(job: JobSpec, path: Path) -> tuple[Any, LaunchOptions]:
    """(config, options) of a launch file written for `job` (ValueError naming the file)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or set(data) != {"kind", "config", "options"}:
        raise ValueError(f"{path}: not a launch file (expected the keys kind, config, options)")
    if data["kind"] != job.kind:
        raise ValueError(
            f"{path}: the launch file of a job of kind {data['kind']!r}, read by the {job.kind!r} rank entry"
        )
    options = LaunchOptions.from_dict(data["options"], f"{path} options")
    return job.config_from_dict(data["config"], ""), options
