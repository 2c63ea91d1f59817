"""pytest plugin (entry point `pytest11`): check training runs against committed goldens in CI.

    def test_tiny_dense(golden_run):                      # the callable form
        golden_run("tiny-dense", recipe="tiny-dense", steps=4, nproc=2)

    @pytest.mark.golden("tiny-moe", recipe="tiny-moe", steps=4)
    def test_tiny_moe(golden_run):                         # the marker form
        assert golden_run.passed                           # checked before the body runs

    def test_my_model(golden_run):                         # another project's own training
        golden_run("my-model", run=lambda out: my_train(out_dir=out, steps=3))

A golden named NAME lives in `<golden dir>/NAME/`; the golden dir is `--golden-dir`, else the ini
option `golden_dir`, else `tests/golden`, relative to pytest's rootdir. It is the fixture
`golden_directory`, so a conftest.py can point its directory's tests elsewhere (this project's
tests/golden/conftest.py points at the goldens shipped in the package, titan_audit/goldens/).

Guarantees:
- The run goes into the test's tmp_path and is checked with `golden.check_golden`: exact when
  the numerics fingerprints are compatible, tolerance mode otherwise. A failed check fails the
  test with the check's report (first divergence, metric mismatches). A pass in tolerance mode
  is never silent: it emits a `GoldenToleranceWarning` (shown in pytest's summary) naming the
  fingerprint fields that differ, and `--golden-require-exact` (or `require_exact=True` for one
  call, e.g. for a BI-mode golden, which is exact on every CPU) makes it a failure.
- `--golden-update` records a missing golden or updates an existing one from the run instead of
  checking, and reports what changed (as a `GoldenUpdatedWarning`); a golden whose compared
  content would not change is left byte for byte as it is. The result is then a `GoldenUpdate`
  (`passed` True, `mode` "update"), so a test body's `assert golden_run.passed` holds in both
  modes. Without it a missing golden
  fails the test and says how to create it. A corrupt golden fails the test as corrupt.
- The default runner is `titan-audit train --config RECIPE --steps N --nproc W` in a subprocess
  (the trainer's own launcher, torchrun for W > 1), so every run starts from a fresh process and
  the test process's global torch state plays no part. `run=callable(out_dir)` replaces it.
- Registers the `golden` marker (pytest runs with --strict-markers here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

DEFAULT_GOLDEN_DIR = "tests/golden"


class GoldenToleranceWarning(UserWarning):
    """A golden check passed in tolerance mode (the numerics fingerprints differ), not bitwise."""


class GoldenUpdatedWarning(UserWarning):
    """--golden-update rewrote (or created) a golden."""


@dataclass(frozen=True)
class GoldenUpdate:
    """What `golden_run` returns under --golden-update: the golden was recorded or updated, not
    checked. `passed` is True so that one test body serves both modes."""

    golden: Path
    recorded: bool  # the golden did not exist and was recorded from the run
    rewritten: bool  # its files changed (always True when recorded)
    changes: dict[str, Any] = field(default_factory=dict)
    passed: bool = True
    mode: str = "update"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("titan-audit golden")
    group.addoption(
        "--golden-update",
        action="store_true",
        default=False,
        help="Record missing goldens and update existing ones from this session's runs.",
    )
    group.addoption(
        "--golden-dir",
        default=None,
        help=f"Directory of the goldens (default: ini golden_dir or {DEFAULT_GOLDEN_DIR}).",
    )
    group.addoption(
        "--golden-require-exact",
        action="store_true",
        default=False,
        help="Fail a golden check that can only run in tolerance mode (fingerprints differ).",
    )
    parser.addini(
        "golden_dir",
        help=f"Directory of the goldens, relative to rootdir (default {DEFAULT_GOLDEN_DIR}).",
        default=DEFAULT_GOLDEN_DIR,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "golden(name, recipe=None, steps=None, nproc=1, overrides=(), run=None): run a recipe (or `run(out_dir)`) "
        "and check it against the golden <golden dir>/<name>/ before the test body; the golden_run fixture "
        "is then the GoldenCheck",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("golden") is not None and "golden_run" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.usefixtures("golden_run"))


def golden_dir(config: pytest.Config) -> Path:
    chosen = config.getoption("--golden-dir") or config.getini("golden_dir") or DEFAULT_GOLDEN_DIR
    path = Path(chosen)
    return path if path.is_absolute() else Path(config.rootpath) / path


def train_recipe(
    out: Path,
    recipe: str,
    *,
    steps: int | None = None,
    nproc: int = 1,
    overrides: Sequence[str] = (),
    timeout: float = 900,
) -> None:
    """`titan-audit train` in a subprocess; raises with its output when it fails."""
    command = [sys.executable, "-m", "titan_audit.cli", "train", "--config", recipe, "--out", str(out)]
    if steps is not None:
        command += ["--steps", str(steps)]
    if nproc != 1:
        command += ["--nproc", str(nproc)]
    for override in overrides:
        command += ["--set", override]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )


class GoldenRunner:
    """The `golden_run` fixture's callable: run, then check against (or update) a golden."""

    def __init__(self, config: pytest.Config, tmp_path: Path, nodeid: str = "", directory: Path | None = None) -> None:
        self.config = config
        self.nodeid = nodeid
        self.tmp_path = tmp_path
        self.directory = golden_dir(config) if directory is None else Path(directory)
        self.update = bool(config.getoption("--golden-update"))
        self.require_exact = bool(config.getoption("--golden-require-exact"))
        self._count = 0

    def __call__(
        self,
        name: str,
        *,
        recipe: str | None = None,
        steps: int | None = None,
        nproc: int = 1,
        overrides: Sequence[str] = (),
        run: Callable[[Path], Any] | None = None,
        require_exact: bool | None = None,
    ):
        from titan_audit.golden import GoldenCorrupt, check_golden, record_golden, update_golden
        from titan_audit.golden.report import check_report

        if (recipe is None) == (run is None):
            raise ValueError("golden_run: give exactly one of recipe= (a titan-audit recipe) and run= (a callable)")
        self._count += 1
        out = self.tmp_path / f"golden-run-{self._count}"
        if run is not None:
            run(out)
            source = f"pytest {self.nodeid}: {getattr(run, '__qualname__', repr(run))}(out_dir)"
        else:
            train_recipe(out, recipe, steps=steps, nproc=nproc, overrides=overrides)
            source = " ".join(
                [
                    "titan-audit train --config",
                    recipe,
                    *(["--steps", str(steps)] if steps else []),
                    "--nproc",
                    str(nproc),
                    *[f"--set {o}" for o in overrides],
                ]
            )
        golden = self.directory / name
        if self.update:
            if golden.exists():
                changes = update_golden(out, golden, source=source)
                verb = "updated" if changes["rewritten"] else "unchanged (not rewritten)"
                warnings.warn(
                    GoldenUpdatedWarning(f"golden {golden} {verb}: {json.dumps(_brief(changes), default=str)}"),
                    stacklevel=2,
                )
                return GoldenUpdate(golden, recorded=False, rewritten=bool(changes["rewritten"]), changes=changes)
            summary = record_golden(out, golden, source=source)
            warnings.warn(
                GoldenUpdatedWarning(
                    f"golden {golden} recorded: {summary['records']} records, {summary['bytes']} bytes"
                ),
                stacklevel=2,
            )
            return GoldenUpdate(golden, recorded=True, rewritten=True, changes=summary)
        if not golden.exists():
            pytest.fail(
                f"no golden {golden}; create it with `pytest --golden-update` (or `titan-audit golden record`)",
                pytrace=False,
            )
        try:
            exact = self.require_exact if require_exact is None else require_exact
            result = check_golden(out, golden, require_exact=exact)
        except GoldenCorrupt as error:
            pytest.fail(f"corrupt golden: {error}", pytrace=False)
        if not result.passed:
            report = "\n".join(check_report(result.to_dict()))
            pytest.fail(f"golden check failed ({result.mode} mode):\n{report}", pytrace=False)
        if result.mode != "exact":
            warnings.warn(
                GoldenToleranceWarning(
                    f"golden {golden} passed in TOLERANCE mode, not bitwise; numerics fingerprint fields that differ: "
                    + "; ".join(result.fingerprint_differences)
                ),
                stacklevel=2,
            )
        return result


def _brief(changes: dict[str, Any]) -> dict[str, Any]:
    audit = changes.get("audit") or {}
    return {
        "fingerprint_changes": changes.get("fingerprint_changes"),
        "audit_identical": audit.get("identical"),
        "audit_differing": audit.get("differing"),
        "metric_changes": [m["metric"] for m in changes.get("metric_changes", [])],
        "previous_corrupt": changes.get("previous_corrupt"),
    }


@pytest.fixture
def golden_directory(request: pytest.FixtureRequest) -> Path:
    """Where `golden_run` reads and writes goldens (see the module doc); override it in a conftest.py."""
    return golden_dir(request.config)


@pytest.fixture
def golden_run(request: pytest.FixtureRequest, tmp_path: Path, golden_directory: Path):
    """A `GoldenRunner`; on a test marked `@pytest.mark.golden(name, ...)`, the GoldenCheck of that
    marker's run (done before the test body; a GoldenUpdate under --golden-update)."""
    runner = GoldenRunner(request.config, tmp_path, request.node.nodeid, golden_directory)
    marker = request.node.get_closest_marker("golden")
    if marker is None:
        return runner
    if len(marker.args) != 1:
        raise ValueError(f"{request.node.nodeid}: @pytest.mark.golden takes the golden's name as its one argument")
    return runner(marker.args[0], **marker.kwargs)
