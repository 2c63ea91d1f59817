"""The README and docs/*.md are tested: every fenced ```bash / ```python block runs here, unless the
line before it says why it cannot (`<!-- illustrative: WHY -->`); a ```python block under `<!-- pytest -->`
is a test module and runs under pytest with the package's plugin; ```console and ```text blocks
are transcripts and synopses, read by people (the tour's `runs/demo/...` paths are checked to be
what `titan-audit demo --out runs/demo` writes). A block with no language is an error, so a new
block cannot slip past the test; a new page in docs/ is picked up by its name.

Shell blocks run in a temporary directory with the venv's `titan-audit` on PATH. Paths into the
checkout are made absolute, and sizes are cut down by SMALL: each entry must apply to some block,
so a README edit that a substitution no longer matches fails here instead of running full size.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = {"bash", "python"}
READ_LANGS = {"console", "text"}
MARKER = re.compile(r"<!--\s*(illustrative|pytest)\s*(?::\s*(.*?))?\s*-->")

# Paths of the checkout, for blocks that run from a temporary directory.
PATHS = [("recipes/", f"{ROOT}/recipes/"), ("titan_audit/goldens/", f"{ROOT}/titan_audit/goldens/")]
# Full-size figures of the README -> small ones for the test (each must match somewhere).
SMALL = [
    ("--num 40000", "--num 600"),
    ("rl-warmup.toml --out", "rl-warmup.toml --steps 2 --set checkpoint.interval=2 --out"),
    (
        "--steps 300 --out runs/rl-verify",
        "--steps 1 --set task.prompts_per_step=2 --set task.samples_per_prompt=2 --out runs/rl-verify",
    ),
]


@dataclass(frozen=True)
class Block:
    page: str  # the file, relative to the checkout
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: str | None  # "illustrative" | "pytest" | None
    why: str

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and self.marker != "illustrative"

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: the fence is never closed"
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.fullmatch(before.strip())
        blocks.append(
            Block(
                page,
                start + 1,
                fence.group(1),
                "\n".join(body) + "\n",
                marker.group(1) if marker else None,
                (marker.group(2) or "") if marker else "",
            )
        )
        i += 1
    return blocks


BLOCKS = [block for path in PAGES for block in readme_blocks(path.read_text(), str(path.relative_to(ROOT)))]
SHELL = [b for b in BLOCKS if b.runs and b.lang == "bash"]
PYTHON = [b for b in BLOCKS if b.runs and b.lang == "python" and b.marker is None]
PYTEST = [b for b in BLOCKS if b.runs and b.lang == "python" and b.marker == "pytest"]


def small(body: str) -> str:
    for old, new in [*PATHS, *SMALL]:
        body = body.replace(old, new)
    return body


def test_every_block_is_run_or_says_why_not():
    assert BLOCKS, "no fenced block found in README.md or docs/"
    for block in BLOCKS:
        assert block.lang in RUN_LANGS | READ_LANGS, (
            f"{block}: give the block a language: bash or python (run by this test), console or text (read only)"
        )
        if block.marker == "illustrative":
            assert block.lang in RUN_LANGS and block.why, f"{block}: `<!-- illustrative: WHY -->` needs its reason"
        if block.marker == "pytest":
            assert block.lang == "python", f"{block}: `<!-- pytest -->` marks a python block"
    assert SHELL and PYTHON and PYTEST, "the docs lost their runnable shell, Python or pytest-plugin block"


def test_small_sizes_all_apply():
    """Each cut-down applies to a block that runs, so no block silently runs at full size."""
    bodies = "".join(b.body for b in SHELL)
    for old, _ in SMALL:
        assert old in bodies, f"SMALL entry {old!r} matches no shell block of the README or docs/ any more"


@pytest.mark.control
def test_the_block_parser_sees_markers_and_unlabelled_fences():
    """Negative control for the checks above: an unlabelled fence and a reasonless marker are caught."""
    text = "x\n<!-- illustrative -->\n```bash\nrm -rf /\n```\n\n```\nplain\n```\n"
    marked, plain = readme_blocks(text)
    assert marked.marker == "illustrative" and not marked.why and not marked.runs
    assert plain.lang == "" and not plain.runs


def demo_run_names() -> set[str]:
    """The run directories `titan-audit demo` creates: every `demo.path(role, "NAME")` in demo/."""
    trees = [ast.parse(path.read_text()) for path in sorted((ROOT / "titan_audit" / "demo").rglob("*.py"))]
    names = {"reports", "logs", "demo.json"}
    for node in (node for tree in trees for node in ast.walk(tree)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "path"
            and len(node.args) == 2
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(node.args[1].value)
    return names


def test_the_demo_transcript_uses_the_paths_the_demo_writes():
    text = "".join(path.read_text() for path in PAGES)
    assert "titan-audit demo --out runs/demo" in text, "the demo's transcript must say how runs/demo/ was made"
    names = demo_run_names()
    assert {"train-w1", "train-w2"} <= names, names  # the scan finds the demo's runs
    used = set(re.findall(r"runs/demo/([\w.-]+)", text))
    assert used and used <= names, f"the docs name runs/demo/ entries the demo never writes: {used - names}"


def run_environment(tmp_path: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    env.pop("TITAN_AUDIT_VERBOSE", None)
    return env


def run(command: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=cwd, env=run_environment(cwd), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(command[:3])} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_shell_block_runs(block, tmp_path):
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + small(block.body))
    run(["bash", str(script)], tmp_path)


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block_runs(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.body)
    run([sys.executable, str(script)], tmp_path)


@pytest.mark.parametrize("block", PYTEST, ids=str)
def test_pytest_plugin_block_runs(block, tmp_path):
    """The plugin example as a project's test file, against the goldens shipped in the package,
    checked (exit 0) and under --golden-update into a copy (the marker form must work there too)."""
    (tmp_path / "test_golden_example.py").write_text(block.body)
    goldens = ROOT / "titan_audit" / "goldens"
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error::UserWarning"]
    proc = run([*base, "--golden-dir", str(goldens)], tmp_path)
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout
