"""Importing titan_audit before torch turns on torch's transparent-huge-page allocation
(titan_audit/__init__.py), and a user's own THP_MEM_ALLOC_ENABLE is kept. The effect is counted
in page faults: touching a fresh 64 MB tensor takes ~16k minor faults with 4 KB pages, a few
dozen with 2 MB ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PROBE = (
    "import titan_audit, torch, os, resource; "
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
    "t = torch.empty(1 << 24, dtype=torch.float32); t.fill_(1.0); "  # 64 MB, first touch
    "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)"
)
PAGES_4K = (64 << 20) // 4096

pytestmark = pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="this kernel has no transparent huge pages (or they are off)",
)


def _probe(env_value: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    value, faults = done.stdout.split()
    return value, int(faults)


def test_import_enables_huge_page_allocation():
    value, faults = _probe(None)
    assert value == "1"
    assert faults < PAGES_4K // 8, f"{faults} minor faults touching 64 MB: not huge pages"


def test_a_users_setting_is_kept_and_the_check_can_fail():
    # negative control: the user's 0 is kept, and the same count sees 4 KB pages
    value, faults = _probe("0")
    assert value == "0"
    assert faults >= PAGES_4K // 2
