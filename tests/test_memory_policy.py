"""Importing titan_audit before torch sets the process's memory policy (titan_audit/memory_policy.py),
and a user's own settings are kept. Both effects are counted in minor page faults:
- huge pages: touching a fresh 64 MB tensor takes ~16k faults with 4 KB pages, a few dozen with
  2 MB ones;
- glibc's malloc kept from mmap and trim: allocating, filling and freeing a 4 MB or a 64 MB tensor
  again and again takes no fault once the heap has settled and its memory is reused; with glibc's
  defaults each round maps a fresh region and faults it in (~512 faults per 4 MB round beside
  torch's huge-page alignment, ~32 per 64 MB round in 2 MB pages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_audit import memory_policy

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
FRESH_64MB = (
    "import titan_audit, torch, os, resource; "
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
    "t = torch.empty(1 << 24, dtype=torch.float32); t.fill_(1.0); "  # 64 MB, first touch
    "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)"
)
ROUNDS = 20
# glibc places small blocks in the holes big ones leave, so a 4 MB round can land on fresh memory
# for its first ~16 rounds (seen under pytest) before the heap settles; what counts is the reuse after
WARM_UP_ROUNDS = 40
REUSED = (
    "import titan_audit, torch, resource, sys\n"
    "from titan_audit import memory_policy\n"
    "def round_():\n"
    "    t = torch.empty(int(sys.argv[1]) >> 2, dtype=torch.float32); t.fill_(1.0); del t\n"
    f"for _ in range({WARM_UP_ROUNDS}): round_()\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    f"for _ in range({ROUNDS}): round_()\n"
    "print(memory_policy.applied_mallopt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
)
MB_4, MB_64 = 4 << 20, 64 << 20
PAGES_4K = (64 << 20) // 4096
POLICY_VARIABLES = ("THP_MEM_ALLOC_ENABLE", "TITAN_AUDIT_MALLOC", *memory_policy.USER_MALLOC_SETTINGS)

pytestmark = [
    pytest.mark.skipif(
        not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
        reason="this kernel has no transparent huge pages (or they are off)",
    ),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the malloc thresholds are glibc's"),
]


def _run(probe: str, *args: str, **env_values: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES}
    env.update(env_values)
    done = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, check=True)
    value, faults = done.stdout.split()
    return value, int(faults)


def test_import_enables_huge_page_allocation():
    value, faults = _run(FRESH_64MB)
    assert value == "1"
    assert faults < PAGES_4K // 8, f"{faults} minor faults touching 64 MB: not huge pages"


def test_a_users_huge_page_setting_is_kept_and_the_check_can_fail():
    # negative control: the user's 0 is kept, and the same count sees 4 KB pages
    value, faults = _run(FRESH_64MB, THP_MEM_ALLOC_ENABLE="0")
    assert value == "0"
    assert faults >= PAGES_4K // 2


@pytest.mark.parametrize("size", [MB_4, MB_64])
def test_freed_memory_is_reused_without_page_faults(size):
    applied, faults = _run(REUSED, str(size))
    assert applied == "True"
    assert faults < ROUNDS, f"{faults} minor faults in {ROUNDS} rounds of a {size >> 20} MB tensor: not reused"


def test_malloc_opt_out_and_a_users_malloc_setting_are_kept_and_the_check_can_fail():
    # negative control: with glibc's defaults every round maps and faults a fresh region
    applied, faults = _run(REUSED, str(MB_4), TITAN_AUDIT_MALLOC="default")
    assert applied == "False"
    assert faults >= ROUNDS * 256
    applied, faults = _run(REUSED, str(MB_64), TITAN_AUDIT_MALLOC="default")
    assert faults >= ROUNDS * 16
    applied, _ = _run(REUSED, str(MB_4), MALLOC_TRIM_THRESHOLD_="268435456")
    assert applied == "False"
