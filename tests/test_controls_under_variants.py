"""The constructed negative controls hold under every CPU variant this machine can force.

A negative control's difference is one the project constructs (tests/README.md), so it must show
on any CPU. As a help to that rule (not a proof of it), every test marked `control` is run again
in a fresh process under each variant the project can force here; the variables are read when
ATen, MKL, oneDNN and our kernel library load, hence one process per variant:
- our kernel variants: `TITAN_AUDIT_CPU_ISA` = scalar, avx2, avx512 (those this CPU runs, less
  the one it runs unforced);
- ATen's dispatch: `ATEN_CPU_CAPABILITY` = default, avx2, avx512 (likewise);
- MKL: `MKL_CBWR=COMPATIBLE`, `MKL_ENABLE_INSTRUCTIONS=AVX2`; oneDNN: `ONEDNN_MAX_CPU_ISA=AVX2`;
- on an AMD CPU, MKL's Intel code path (`LD_PRELOAD` of scripts/mkl_intel_path.c, built here).
A marked test that fails under any of them fails this test, named with its variant. No forcing on
an AMD CPU reaches AMX, and none on an Intel CPU reaches AMD's code paths.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_audit.batch_invariant.cpu import _lib
from titan_audit.portability.kernel_golden import this_cpu

REPO = Path(__file__).resolve().parents[1]
# The variables a variant sets; each run starts from this environment with all of them removed.
FORCED = (
    "TITAN_AUDIT_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "LD_PRELOAD",
)
RUN_TIMEOUT_S = 600


def _variants() -> list[tuple[str, dict[str, str]]]:
    """The forced variants, less the two that equal what this process runs unforced (the widest
    kernel variant, ATen's own choice): the suite itself runs those."""
    isas = _lib.available_isas()
    widest = isas[-1]
    out = [(f"TITAN_AUDIT_CPU_ISA={isa}", {"TITAN_AUDIT_CPU_ISA": isa}) for isa in isas if isa != widest]
    unforced = torch.backends.cpu.get_cpu_capability().lower()
    capabilities = [c for c in ("default", "avx2", "avx512") if (c == "default" or c in isas) and c != unforced]
    out += [(f"ATEN_CPU_CAPABILITY={c}", {"ATEN_CPU_CAPABILITY": c}) for c in capabilities]
    if platform.machine() == "x86_64":
        out += [
            ("MKL_CBWR=COMPATIBLE", {"MKL_CBWR": "COMPATIBLE"}),
            ("MKL_ENABLE_INSTRUCTIONS=AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
            ("ONEDNN_MAX_CPU_ISA=AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
        ]
        if this_cpu()["vendor"] == "AuthenticAMD":
            out.append(("MKL Intel path", {"LD_PRELOAD": "SHIM"}))
    return out


VARIANTS = _variants()


def _pytest(args: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in FORCED and not k.startswith("PYTEST_XDIST")}


class _Collected:
    """A plugin of the nested collection below: the node ids it selected."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = [item.nodeid for item in session.items]


@pytest.fixture(scope="module")
def controls() -> list[str]:
    """The node ids of the `control`-marked tests: a collection of the whole suite, whatever this
    pytest run selected, in a pytest session nested in this process (an xdist worker has
    imported every test module already, which a subprocess would import again: ~12 s)."""
    collected = _Collected()
    marks = "control and not slow and not gpu and not vllm"
    args = ["--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "--rootdir", str(REPO)]
    code = pytest.main([*args, "-m", marks, str(REPO / "tests")], plugins=[collected])
    assert code == pytest.ExitCode.OK, f"the collection of the suite exited {code!r}"
    ids = collected.ids
    assert ids, "no test is marked control: the variant runs would check nothing"
    return ids


def test_the_marked_controls_are_cheap_single_process_tests(controls: list[str]) -> None:
    """What the variant runs collect: marked tests outside the slow, gpu and vllm ones."""
    assert all(i.startswith("tests/") for i in controls)
    assert len(controls) >= 20, f"only {len(controls)} tests are marked control"


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for _, v in VARIANTS], ids=[name for name, _ in VARIANTS])
def test_every_constructed_control_holds_under_the_forced_variant(
    controls: list[str], variant: dict[str, str], request: pytest.FixtureRequest
) -> None:
    env = {**_clean_env(), **variant}
    if env.get("LD_PRELOAD") == "SHIM":
        env["LD_PRELOAD"] = str(request.getfixturevalue("mkl_intel_path_shim"))
    if "TITAN_AUDIT_CPU_ISA" in variant:
        assert variant["TITAN_AUDIT_CPU_ISA"] in _lib.available_isas()
    done = _pytest(controls, env)
    assert done.returncode == 0, f"{variant}: a constructed control flipped\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
    assert f"{len(controls)} passed" in done.stdout, done.stdout[-3000:]


def test_the_variant_runs_see_a_failing_control(tmp_path: Path) -> None:
    """Negative control: a run of a control that does not hold fails, so the runs above can fail."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import torch\ndef test_flipped():\n    a = torch.ones(3)\n    assert not torch.equal(a, a.clone())\n"
    )
    done = _pytest([str(probe)], _clean_env(), cwd=tmp_path)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-2000:]
