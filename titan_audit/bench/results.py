"""Benchmark results as data: `bench SUITE --save` files and the performance tables made from them.

Guarantees:
- `save_result` writes a suite's JSON (what `bench --json` prints) plus a `saved` section (machine
  kind, CPU vendor / model / family and model numbers / kernel ISA, GPU, commit and whether the
  tree had uncommitted changes, UTC time, the bench options, free-text notes) to
  `<dir>/<suite>-<kind>-<YYYY-MM-DD>-<commit>.json`. The file appears complete or not at all
  (written under a temporary name, then hard-linked into place), and an existing file is never
  replaced: a second save under the same name takes the next free `-2`, `-3`, ... suffix.
- `performance_tables(results)` and `readme_table(results)` are pure functions of the loaded
  files: for each machine kind the newest file of each suite (by its `saved.time`), older files
  stay as history and are never shown. The same files give the same text, byte for byte.
- `replace_between_markers` rewrites only the text between `<!-- perf:NAME:begin -->` and
  `<!-- perf:NAME:end -->` (ValueError when the markers are missing or out of order).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks") / "results"
# Machine kinds in the order the tables list them; a kind not listed here sorts after them by name.
KIND_ORDER = ("intel-avx512", "amd-avx512", "amd-avx2", "intel-avx2")
# The README's one table: (suite, case, baseline, column heading); a case is named by its name and
# its baseline, since a suite may time one candidate against several baselines. A kind without
# the case shows "-".
HEADLINE: tuple[tuple[str, str, str, str], ...] = (
    (
        "train",
        "train tiny-dense W=2 V=8: deterministic + BI ops",
        "deterministic (tree reduction, native ops)",
        "train: BI vs native",
    ),
    ("audit", "small-transformer step, audit full vs off", "Recorder level off", "audit full vs off"),
    ("rl", "rl rl-tiny W=1", "native ops", "RL step: BI vs native"),
    ("rl", "rl rl-tiny W=1 vs TRL", "TRL GRPOTrainer, 1 thread", "RL step vs TRL"),
    ("generate", "generate B=8", "builtin generator, native ops", "generate B=8: BI vs native"),
)
_FILE = re.compile(
    r"^(?P<suite>[a-z]+)-(?P<kind>[a-z0-9-]+)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<commit>[0-9a-f]+)(-\d+)?\.json$"
)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, sep, value = line.partition(":")
            if sep:
                info.setdefault(key.strip(), value.strip())
    return info


def platform_info(machine: dict[str, Any]) -> dict[str, Any]:
    """The CPU (vendor, model name, family / model numbers, the kernel ISA variant the suite ran)
    and the GPU torch sees (None without one); `machine` is the suite's fingerprint section."""
    import torch

    info = _cpuinfo()
    return {
        "cpu_vendor": info.get("vendor_id", "unknown"),
        "cpu_model": info.get("model name", machine.get("device_name") or "unknown"),
        "cpu_family": info.get("cpu family"),
        "cpu_model_number": info.get("model"),
        "cpu_isa": (machine.get("info") or {}).get("cpu_kernel_isa") or "unknown",
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_kind(platform: dict[str, Any]) -> str:
    """ "intel-avx512", "amd-avx2", ...: the CPU vendor and the kernel ISA; "gpu-<name>" with a GPU."""
    if platform.get("gpu"):
        return "gpu-" + re.sub(r"[^a-z0-9]+", "-", platform["gpu"].lower()).strip("-")
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(platform["cpu_vendor"], "cpu")
    return f"{vendor}-{platform['cpu_isa']}"


def source_commit(root: Path | None = None) -> tuple[str, bool]:
    """(the short commit of the titan_audit checkout, whether tracked files differ from it);
    ("v<version>", False) for an installed package outside a git checkout."""
    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=10", "HEAD")
    if commit is None:
        import titan_audit

        return f"v{titan_audit.__version__}", False
    return commit, bool(git("status", "--porcelain", "--untracked-files=no"))


def save_result(
    data: dict[str, Any],
    results_dir: str | os.PathLike,
    *,
    options: dict[str, Any],
    notes: str = "",
    now: dt.datetime | None = None,
    commit: tuple[str, bool] | None = None,
) -> Path:
    """Write `data` (`SuiteResult.to_dict()`) with its `saved` section; return the new file's path."""
    now = now or dt.datetime.now(dt.UTC)
    platform = platform_info(data["machine"])
    kind = machine_kind(platform)
    sha, dirty = commit or source_commit()
    saved = {
        "kind": kind,
        **platform,
        "commit": sha,
        "dirty": dirty,
        "time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "options": options,
        "notes": notes,
    }
    body = (json.dumps({**data, "saved": saved}, indent=1, sort_keys=False, default=str) + "\n").encode()
    directory = Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{data['suite']}-{kind}-{now:%Y-%m-%d}-{sha}"
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        for n in range(1, 1000):
            path = directory / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
            try:
                os.link(tmp, path)  # fails if the name exists: never replaces a file
            except FileExistsError:
                continue
            return path
        raise ValueError(f"{directory}: 999 results named {stem}*.json already; nothing saved")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _umask() -> int:
    from titan_audit.atomic import current_umask

    return current_umask()


def load_results(results_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every saved result in `results_dir` (sorted by file name); ValueError naming a file that is
    not a saved result."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        if not _FILE.match(path.name):
            raise ValueError(f"{path}: not a saved bench result name (SUITE-KIND-DATE-COMMIT.json)")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not readable JSON ({error})") from None
        if not isinstance(data, dict) or not {"suite", "cases", "saved"} <= data.keys():
            raise ValueError(f"{path}: a saved bench result needs the keys suite, cases and saved")
        out.append({**data, "file": path.name})
    return out


def newest(results: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """{(kind, suite): the newest result of that suite on that kind of machine}."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for result in results:
        key = (result["saved"]["kind"], result["suite"])
        if key not in best or (result["saved"]["time"], result["file"]) > (
            best[key]["saved"]["time"],
            best[key]["file"],
        ):
            best[key] = result
    return best


def _kinds(current: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    kinds = {kind for kind, _ in current}
    return sorted(kinds, key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER), k))


def _find(result: dict[str, Any] | None, name: str, baseline: str) -> dict[str, Any] | None:
    cases = result["cases"] if result else []
    return next((c for c in cases if (c["case"], c["baseline"]) == (name, baseline)), None)


def _number(x: float) -> str:
    return f"{x:.3g}"


def _ratio(case: dict[str, Any]) -> str:
    mark = "" if case.get("met_target") is not False else " (missed)"
    return f"{case['ratio']:.3f}x{mark}"


def _run_text(result: dict[str, Any]) -> str:
    saved = result["saved"]
    quick = " quick" if saved["options"].get("quick") else ""
    return f"{saved['time'][:10]} `{saved['commit']}`{' (dirty)' if saved['dirty'] else ''}{quick}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def machines_table(current: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """One row per machine kind: its CPU (or GPU) and the files its current figures come from."""
    lines = ["| machine kind | CPU | kernel ISA | GPU | current files |", "|---|---|---|---|---|"]
    for kind in _kinds(current):
        results = [r for (k, _), r in sorted(current.items()) if k == kind]
        saved = results[-1]["saved"]
        files = ", ".join(f"`{r['file']}`" for r in results)
        lines.append(
            f"| {kind} | {_cell(saved['cpu_model'])} ({saved['cpu_vendor']}, family {saved['cpu_family']} model "
            f"{saved['cpu_model_number']}, {saved['cpu_count']} CPUs) | {saved['cpu_isa']} | {saved['gpu'] or '-'} "
            f"| {files} |"
        )
    return lines


def suite_table(suite: str, current: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """The suite's cases as rows, one column per machine kind (its newest file); the target last."""
    kinds = [k for k in _kinds(current) if (k, suite) in current]
    cases: dict[tuple[str, str], dict[str, Any]] = {}
    for kind in kinds:
        for case in current[(kind, suite)]["cases"]:
            cases.setdefault((case["case"], case["baseline"]), case)
    lines = [
        "| case | baseline -> candidate | " + " | ".join(kinds) + " | target |",
        "|---|---|" + "---:|" * len(kinds) + "---|",
        "| run | | " + " | ".join(_run_text(current[(k, suite)]) for k in kinds) + " | |",
    ]
    for (name, baseline), first in cases.items():
        cells = []
        for kind in kinds:
            found = _find(current[(kind, suite)], name, baseline)
            cells.append(_ratio(found) if found else "-")
        target = f"<= {_number(first['target'])}" if first.get("target") is not None else ""
        lines.append(
            f"| {_cell(name)} | {_cell(baseline)} -> {_cell(first['candidate'])} | "
            + " | ".join(cells)
            + f" | {target} |"
        )
    return lines


def performance_tables(results: Iterable[dict[str, Any]]) -> str:
    """docs/performance.md's generated part: the machines, then one table per suite."""
    current = newest(results)
    lines = ["### Machines", "", *machines_table(current)]
    for suite in sorted({s for _, s in current}):
        lines += ["", f"### `bench {suite}`", "", *suite_table(suite, current)]
        notes = [
            (k, r["saved"]["notes"]) for (k, s), r in sorted(current.items()) if s == suite and r["saved"]["notes"]
        ]
        lines += [""] + [f"Notes ({kind}): {_cell(text)}" for kind, text in notes] if notes else []
    return "\n".join(lines) + "\n"


def readme_table(results: Iterable[dict[str, Any]]) -> str:
    """The README's one table: a row per machine kind, the HEADLINE cases as columns."""
    current = newest(results)
    lines = [
        "| machine | " + " | ".join(heading for *_, heading in HEADLINE) + " | runs |",
        "|---|" + "---:|" * len(HEADLINE) + "---|",
    ]
    for kind in _kinds(current):
        runs = sorted({_run_text(r) for (k, s), r in current.items() if k == kind and s in {h[0] for h in HEADLINE}})
        cells = []
        for suite, name, baseline, _ in HEADLINE:
            case = _find(current.get((kind, suite)), name, baseline)
            cells.append(_ratio(case) if case else "-")
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {'; '.join(runs) or '-'} |")
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, name: str, body: str) -> str:
    """`text` with the lines between `<!-- perf:NAME:begin -->` and `<!-- perf:NAME:end -->` set to `body`."""
    begin, end = f"<!-- perf:{name}:begin -->", f"<!-- perf:{name}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the markers {begin} ... {end} are missing or out of order")
    return text[: start + len(begin)] + "\n" + body + text[stop:]


def generated_pages(root: str | os.PathLike, results_dir: str | os.PathLike | None = None) -> dict[Path, str]:
    """{page: its text with the generated tables of the results in `results_dir` (default
    ROOT/benchmarks/results)}: README.md's `perf:readme` and docs/performance.md's `perf:tables`."""
    root = Path(root)
    results = load_results(results_dir if results_dir is not None else root / RESULTS_DIR)
    if not results:
        raise ValueError(f"{results_dir or root / RESULTS_DIR}: no saved bench results to make the tables from")
    readme, performance = root / "README.md", root / "docs" / "performance.md"
    return {
        readme: replace_between_markers(readme.read_text(), "readme", readme_table(results)),
        performance: replace_between_markers(performance.read_text(), "tables", performance_tables(results)),
    }
