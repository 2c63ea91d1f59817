"""Shared test settings: hypothesis profiles, markers and the pytest-xdist scheduling.

Profiles: `ci` (the default; fixed seed derivation so CI runs are reproducible, no deadline since
2-core machines are noisy) and `dev` (random exploration). Select with HYPOTHESIS_PROFILE=dev.

Under `--dist loadscope` (what `make test` runs: `-n 2 --dist loadscope`) a module's tests run on one
worker, so its module-scoped fixtures are built once; the tests/report modules stay on one worker
together (they share session-scoped runs), and the longest modules are handed out first.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def mkl_intel_path_shim(tmp_path_factory) -> Path:
    """scripts/mkl_intel_path.c built (what `make mkl-intel-path` builds): with it in LD_PRELOAD,
    MKL takes its Intel code paths on an AMD CPU too. Skips without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler (cc) to build scripts/mkl_intel_path.c")
    out = tmp_path_factory.mktemp("shim") / "mkl_intel_path.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(REPO / "scripts/mkl_intel_path.c")], check=True)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# pytest-xdist: `make test` runs the suite on 2 workers with `--dist loadscope` (see the Makefile).
# Work units that must stay on one worker beyond their module: tests/report's modules share the
# session-scoped `runs` fixture (tests/report/conftest.py), which each worker would build again.
XDIST_SHARED_SCOPES = ("tests/report/",)
# The longest work units (from `--durations` on 2 cores) are handed out first, so that neither
# worker is left running one of them at the end while the other idles. Only the order depends on
# this list: a stale entry costs time, never a test.
XDIST_FIRST = (
    "tests/test_controls_under_variants.py",
    "tests/rl/test_loop.py",
    "tests/golden/test_committed_goldens.py",
    "tests/trainer/test_train_cli.py",
    "tests/rl/test_cli_rl.py",
    "tests/test_readme.py",
    "tests/batch_invariant/test_knobs_train.py",
    "tests/golden/test_plugin.py",
    "tests/trainer/test_launch_errors.py",
    "tests/rl/test_learning.py",
    "tests/trainer/test_train.py",
    "tests/batch_invariant/test_knobs.py",
    "tests/trainer/test_tensor_parallel.py",
    "tests/trainer/test_multinode.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `--dist loadscope`: loadscope's grouping (one module per work unit, so a module's
    fixtures are built once), with XDIST_SHARED_SCOPES merged and XDIST_FIRST handed out first."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            shared = next((s for s in XDIST_SHARED_SCOPES if nodeid.startswith(s)), None)
            return shared or super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            for scope in reversed(XDIST_FIRST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)
