"""Merge one stage of scripts/gpu_check.sh into its JSON file (atomically: temp file + rename).

Usage: gpu_check_record.py JSON STAGE RC SECONDS KIND [ARTIFACT]
KIND says how to read the stage's artifact into figures:
  env       ARTIFACT: a JSON object written by the env stage (versions, GPU name)
  pytest    ARTIFACT: a JUnit XML file -> passed / failed / skipped counts and each failing test's id
  bench     ARTIFACT: `titan-audit bench ops --json` -> the CUDA cases (ratio, target, met)
  compare   ARTIFACT: `titan-audit compare --json` -> identical, records compared, differing
  onpolicy  ARTIFACT: `titan-audit verify-onpolicy --json` -> its verdict object
  plain     no artifact
A stage's status: "passed" (rc 0), "timeout" (rc 124 or 137), "failed" otherwise. The file keeps
every stage recorded so far, so a run cut short still returns the figures of the stages it did.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def _pytest(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            test_id = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"] += 1
                out["failures"].append(test_id)
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def _bench(path: Path) -> dict[str, Any]:
    cases = [c for c in json.loads(path.read_text())["cases"] if c["case"].startswith("cuda ")]
    keep = ("case", "baseline_s", "candidate_s", "ratio", "target", "met_target", "device")
    return {
        "cases": [{k: c.get(k) for k in keep} for c in cases],
        "targets_missed": sum(c["met_target"] is False for c in cases),
        "targets": sum(c["target"] is not None for c in cases),
    }


def _compare(path: Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    return {k: result.get(k) for k in ("identical", "compared", "differing", "first_divergence")}


READERS = {
    "env": lambda p: json.loads(p.read_text()),
    "pytest": _pytest,
    "bench": _bench,
    "compare": _compare,
    "onpolicy": lambda p: json.loads(p.read_text()),
}


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    json_path, stage, rc, seconds, kind = Path(argv[0]), argv[1], int(argv[2]), float(argv[3]), argv[4]
    record: dict[str, Any] = {
        "status": "passed" if rc == 0 else "timeout" if rc in (124, 137) else "failed",
        "rc": rc,
        "seconds": round(seconds, 1),
    }
    if kind != "plain":
        artifact = Path(argv[5])
        try:
            record["figures"] = READERS[kind](artifact)
        except (OSError, ValueError, KeyError, ET.ParseError) as exc:
            record["figures"] = None
            record["artifact_error"] = f"{artifact}: {exc}"
    result = json.loads(json_path.read_text()) if json_path.is_file() else {"stages": {}}
    result["stages"][stage] = record
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, json_path)
    print(f"== {stage}: {record['status']} ({record['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
