"""The kernel golden (`tests/golden/kernels.json`): one hash per (kernel, case) of the battery's
outputs, and per (op, case) of the BI-mode torch ops, that every CPU must reproduce exactly.

Guarantees:
- `check` runs the battery (natively, or arm64 under qemu-user) and/or the torch-ops section and
  compares every record of every ISA variant and thread count with the golden's one hash for its
  case, by hash (raw bits), never by tolerance. Every difference is named: kernel, case, variant,
  threads, and the first differing element with both values whenever a record here reproduces
  the golden hash (the golden keeps hashes only). A case the golden has and the battery did not
  run, or the reverse, is a difference too.
- The file is validated on load: a missing file, invalid JSON, another format or version, or a
  malformed entry is a `ValueError` naming the file (bad input, exit 2 in the CLI); a hash that
  does not match is a difference (exit 1), never "corrupt".
- `record` writes the hashes only when every variant and thread count of every case agree here,
  refuses an existing file unless `force`, keeps the other section when recording one, and
  writes atomically (temporary file + rename, `titan_audit.atomic`).
- `passed_on` lists the CPUs the golden passed on; only `mark_passed` appends to it, after a
  passing check, and an identical CPU (vendor, model, cpuid family/model/stepping, arch, ISA
  flags) is updated in place, not repeated. Re-recording a section takes that section off every
  entry (entries left with none go).
- The kernel section needs no torch (`battery.py`); the torch-ops section imports it
  (`torch_ops.py`).
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import re
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from titan_audit.atomic import write_json_atomic
from titan_audit.portability import battery
from titan_audit.portability.battery import CaseOutputs

DEFAULT_PATH = battery.ROOT / "tests" / "golden" / "kernels.json"
FORMAT = "titan-audit kernel golden"
FORMAT_VERSION = 1
SECTIONS = ("kernels", "torch_ops")
HASH = "xxh3-128 (hex) of each record's raw output bytes"
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "asimd",
    "sve",
)
MAX_LISTED = 200  # mismatches kept per section in a result (the count is always complete)
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


# ---------------------------------------------------------------- the file


def load(path: Path) -> dict:
    """The golden at `path`, validated (see the module doc); ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"kernel golden {path}: no such file (record one with `titan-audit golden kernels --record`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"kernel golden {path} is corrupt: {error}") from None
    problem = _invalid(data)
    if problem:
        raise ValueError(f"kernel golden {path} is corrupt: {problem}")
    return data


def _invalid(data: object) -> str | None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"not a {FORMAT!r} file"
    if data.get("format_version") != FORMAT_VERSION:
        return f"format_version {data.get('format_version')!r}, this titan-audit reads {FORMAT_VERSION}"
    if not isinstance(data.get("passed_on"), list):
        return "no passed_on list"
    for name in SECTIONS:
        section = data.get(name)
        if section is None:
            continue
        if not isinstance(section, dict) or not isinstance(section.get("cases"), dict):
            return f"section {name!r} has no cases"
        for key, entry in section["cases"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("hash"), str) or not _HEX32.match(entry["hash"]):
                return f"{name} case {key!r}: no 32-hex-digit hash"
            if entry.get("dtype") not in battery.DTYPES or not isinstance(entry.get("count"), int):
                return f"{name} case {key!r}: bad dtype or count"
    if not any(data.get(name) for name in SECTIONS):
        return "neither a kernels nor a torch_ops section"
    return None


# ---------------------------------------------------------------- this machine


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in info:
            info[key.strip()] = value.strip()
    return info


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - the kernel section runs without torch
        return None
    return torch.__version__


def this_cpu(arch: str = "native", variants: Iterable[str] = ()) -> dict:
    """{vendor, model, cpuid, isa, variants, arch, torch}: the CPU a check ran on (arm64: the emulator)."""
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    host_model = info.get("model name", platform.processor() or "unknown")
    entry = {
        "vendor": info.get("vendor_id", "unknown"),
        "model": host_model,
        "cpuid": " ".join(
            f"{k} {info[k2]}"
            for k, k2 in (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
            if k2 in info
        )
        or None,  # a virtual machine may mask the model name
        "isa": [f for f in ISA_FLAGS if f in flags],
        "variants": list(variants),
        "arch": platform.machine(),
        "torch": _torch_version(),
    }
    if arch == "aarch64":
        try:
            qemu = subprocess.run([battery.emulator(), "--version"], capture_output=True, text=True, check=False)
            version = qemu.stdout.splitlines()[0].strip() if qemu.stdout else "qemu-aarch64"
        except ValueError:
            version = "qemu-aarch64"
        entry.update(
            vendor="qemu-user", model=f"{version} (emulated on {host_model})", cpuid=None, isa=[], arch="aarch64"
        )
    return entry


def _same_cpu(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("vendor", "model", "cpuid", "arch", "isa"))


# ---------------------------------------------------------------- running the sections


def _cases(section: str, arch: str, only: str | None) -> Iterator[CaseOutputs]:
    if section == "kernels":
        return battery.run_cases(arch, only=only)
    if arch != "native":
        raise ValueError(
            "the torch-ops section runs natively only (torch does not run under qemu); use --section kernels"
        )
    from titan_audit.portability import torch_ops

    return torch_ops.run_cases(only=only)


def _variants(section: str, arch: str) -> list[str]:
    if section == "kernels":
        return battery.variants(arch)
    from titan_audit.portability import torch_ops

    return torch_ops.variants()


def _kernels_version(case: CaseOutputs) -> int | None:
    if case.key != "info/constants" or not case.records:
        return None
    return int(np.frombuffer(case.records[0].data, "<i8")[0])


def _check_section(name: str, golden: dict, arch: str, only: str | None) -> dict:
    section = golden.get(name) or {}
    expected: dict = section.get("cases", {})
    start = time.perf_counter()
    mismatches: list[dict] = []
    n_mismatch = 0
    seen: set[str] = set()
    unexpected: list[str] = []
    cases = records = 0
    version = None
    variants = _variants(name, arch)
    threads: set[int] = set()
    for case in _cases(name, arch, only):
        cases += 1
        records += len(case.records)
        seen.add(case.key)
        version = _kernels_version(case) if version is None else version
        threads.update(r.threads for r in case.records if r.threads)  # 0: no thread count
        want = expected.get(case.key)
        if want is None:
            unexpected.append(case.key)
            continue
        reference = next((r for r in case.records if r.digest == want["hash"]), None)
        for rec in case.records:
            if rec.digest == want["hash"] and (case.dtype, case.count) == (want["dtype"], want["count"]):
                continue
            n_mismatch += 1
            if len(mismatches) >= MAX_LISTED:
                continue
            item = {
                "kernel": case.kernel,
                "case": case.case,
                "variant": rec.variant,
                "threads": rec.threads,
                "expected": want["hash"],
                "got": rec.digest,
                "first_difference": None,
                "note": None,
            }
            if (case.dtype, case.count) != (want["dtype"], want["count"]):
                item["note"] = (
                    f"the golden has {want['count']} {want['dtype']} here, this run {case.count} {case.dtype}"
                )
            elif reference is not None:
                diff = battery.first_difference(case.dtype, reference.data, rec.data)
                item["first_difference"] = None if diff is None else diff.to_dict()
                item["note"] = (
                    f"golden values from {reference.variant}, threads {reference.threads}, which has the golden's bits"
                )
            else:
                item["note"] = "no variant or thread count here has the golden's bits; the golden keeps hashes only"
            mismatches.append(item)
    missing = sorted(k for k in expected if k not in seen and (not only or k.startswith(only)))
    result = {
        "checked": True,
        "passed": n_mismatch == 0 and not missing and not unexpected,
        "cases": cases,
        "records": records,
        "variants": variants,
        "threads": sorted(threads),
        "mismatch_count": n_mismatch,
        "mismatches": mismatches,
        "missing": missing,
        "unexpected": sorted(unexpected),
        "seconds": round(time.perf_counter() - start, 3),
    }
    if name == "kernels":
        result["kernels_version"] = {"golden": section.get("kernels_version"), "here": version}
    else:
        result["torch"] = {"golden": section.get("torch"), "here": _torch_version()}
    return result


def _sections(section: str, arch: str) -> tuple[str, ...]:
    if section in ("all", None):
        return ("kernels",) if arch == "aarch64" else SECTIONS
    name = section.replace("-", "_")
    if name not in SECTIONS:
        raise ValueError(f"unknown golden section {section!r}; choose from kernels, torch-ops, all")
    if name == "torch_ops" and arch != "native":
        raise ValueError(
            "the torch-ops section runs natively only (torch does not run under qemu); use --section kernels"
        )
    return (name,)


def check(path: Path = DEFAULT_PATH, *, arch: str = "native", section: str = "all", only: str | None = None) -> dict:
    """Check this machine against the golden (see the module doc). One JSON-able dict with stable
    keys: passed, golden, arch, cpu, sections {kernels, torch_ops}: {checked, passed, cases,
    records, variants, threads, mismatch_count, mismatches, missing, unexpected, seconds, ...}."""
    path = Path(path)
    golden = load(path)
    if arch not in battery.ARCHES:
        raise ValueError(f"unknown --arch {arch!r}; choose from {', '.join(battery.ARCHES)}")
    names = _sections(section, arch)
    for name in names:
        if not golden.get(name):
            raise ValueError(
                f"kernel golden {path} has no {name} section "
                f"(record it with --record --section {name.replace('_', '-')})"
            )
    results = {name: {"checked": False} for name in SECTIONS}
    for name in names:
        results[name] = _check_section(name, golden, arch, only)
    variants = sorted({v for name in names for v in results[name]["variants"]}, key=["scalar", "avx2", "avx512"].index)
    return {
        "passed": all(results[name]["passed"] for name in names),
        "golden": str(path),
        "arch": "aarch64" if arch == "aarch64" else platform.machine(),
        "only": only,
        "cpu": this_cpu(arch, variants),
        "sections": results,
        "marked_passed": None,
    }


def record(path: Path = DEFAULT_PATH, *, arch: str = "native", section: str = "all", force: bool = False) -> dict:
    """Record the hashes of this machine's run (see the module doc). Returns {recorded, golden,
    sections: {name: {cases, records, variants}}, disagreements: [...]}; nothing is written when
    any case's variants or thread counts disagree here (`recorded` False)."""
    path = Path(path)
    if path.exists() and not force:
        raise ValueError(f"kernel golden {path} already exists; pass --force to replace it")
    names = _sections(section, arch)
    old = load(path) if path.exists() and len(names) < len(SECTIONS) else None
    out = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "hash": HASH,
        "about": "Written by `titan-audit golden kernels --record`; checked by `titan-audit golden kernels`; "
        "passed_on is appended by `--mark-passed` after a passing check. Never edit by hand.",
        "kernels": None,
        "torch_ops": None,
        "passed_on": [],
    }
    if old is not None:
        for name in SECTIONS:
            out[name] = old.get(name)
        out["passed_on"] = old.get("passed_on", [])
    summary: dict = {"recorded": False, "golden": str(path), "sections": {}, "disagreements": []}
    date = dt.datetime.now(dt.UTC).date().isoformat()
    for name in names:
        cases: dict[str, dict] = {}
        records = 0
        version = None
        for case in _cases(name, arch, None):
            records += len(case.records)
            version = _kernels_version(case) if version is None else version
            digests = {r.digest for r in case.records}
            if len(digests) != 1:
                first = case.records[0]
                other = next(r for r in case.records if r.digest != first.digest)
                diff = battery.first_difference(case.dtype, first.data, other.data)
                summary["disagreements"].append(
                    {
                        "section": name,
                        "kernel": case.kernel,
                        "case": case.case,
                        "variants": [f"{r.variant}/threads {r.threads}: {r.digest}" for r in case.records],
                        "first_difference": None if diff is None else diff.to_dict(),
                    }
                )
                continue
            cases[case.key] = {"hash": digests.pop(), "dtype": case.dtype, "count": case.count}
        variants = _variants(name, arch)
        entry = {"recorded": {**this_cpu(arch, variants), "date": date}, "cases": cases}
        if name == "kernels":
            entry = {"kernels_version": version, **entry}
        else:
            entry = {"torch": _torch_version(), **entry}
        out[name] = entry
        summary["sections"][name] = {"cases": len(cases), "records": records, "variants": variants}
    if summary["disagreements"]:
        return summary
    kept = []
    for cpu in out["passed_on"]:
        cpu = dict(cpu, sections=[s for s in cpu.get("sections", []) if s not in names])
        if cpu["sections"]:
            kept.append(cpu)
    out["passed_on"] = kept
    _write(path, out)
    summary["recorded"] = True
    return summary


def _write(path: Path, golden: dict) -> None:
    write_json_atomic(path, golden, overwrite=True)
    path.chmod(0o644)  # a committed file, readable by all (the temporary file was 0600)


def mark_passed(path: Path, result: dict) -> dict:
    """Append the CPU of a passing `check` result to the golden's passed_on (identical CPUs are
    updated in place); returns the entry. ValueError for a result that did not pass."""
    if not result.get("passed"):
        raise ValueError("--mark-passed: the check did not pass; nothing is appended")
    path = Path(path)
    golden = load(path)
    sections = [name for name, r in result["sections"].items() if r.get("checked") and r.get("passed")]
    if result.get("only"):
        raise ValueError("--mark-passed needs a check of every case (drop --case)")
    entry = {**result["cpu"], "date": dt.datetime.now(dt.UTC).date().isoformat(), "sections": sections}
    for i, cpu in enumerate(golden["passed_on"]):
        if _same_cpu(cpu, entry):
            merged = sorted(set(cpu.get("sections", [])) | set(sections), key=SECTIONS.index)
            golden["passed_on"][i] = {**entry, "sections": merged}
            entry = golden["passed_on"][i]
            break
    else:
        golden["passed_on"].append(entry)
    _write(path, golden)
    return entry


# ---------------------------------------------------------------- reports


def check_report(result: dict) -> list[str]:
    """Human lines for a `check` result."""
    cpu = result["cpu"]
    lines = [
        f"kernel golden {result['golden']}: {'PASS' if result['passed'] else 'FAIL'} on {result['arch']} "
        f"({cpu['vendor']} {cpu['model']}; variants {' '.join(cpu['variants'])})"
    ]
    for name, r in result["sections"].items():
        if not r.get("checked"):
            continue
        label = name.replace("_", "-")
        lines.append(
            f"  {label}: {'pass' if r['passed'] else 'FAIL'}: {r['cases']} cases, {r['records']} records "
            f"(variants {' '.join(r['variants'])}; threads {' '.join(map(str, r['threads']))}) in {r['seconds']:.1f} s"
        )
        version = r.get("kernels_version")
        if version and version["here"] is not None and version["golden"] != version["here"]:
            lines.append(
                f"    the golden was recorded with kernels version {version['golden']}, these are version "
                f"{version['here']}: if the change is intended, re-record (--record --force)"
            )
        torch_v = r.get("torch")
        if torch_v and torch_v["golden"] != torch_v["here"]:
            lines.append(f"    recorded with torch {torch_v['golden']}, running torch {torch_v['here']}")
        for m in r["mismatches"][:20]:
            where = f"{m['kernel']}/{m['case']} [{m['variant']}, threads {m['threads']}]"
            text = f"    {where}: hash {m['got']} != golden {m['expected']}"
            d = m["first_difference"]
            if d is not None:
                text += (
                    f"; first differing element {d['index']}: golden {d['expected']} ({d['expected_bits']}), "
                    f"here {d['got']} ({d['got_bits']})"
                )
            if m["note"]:
                text += f" ({m['note']})"
            lines.append(text)
        if r["mismatch_count"] > 20:
            lines.append(f"    ... {r['mismatch_count'] - 20} more differing records (--json lists up to {MAX_LISTED})")
        for key in r["missing"][:10]:
            lines.append(f"    {key}: in the golden, not run here")
        for key in r["unexpected"][:10]:
            lines.append(f"    {key}: run here, not in the golden (re-record?)")
    if result.get("marked_passed"):
        lines.append(f"  passed_on: {result['marked_passed']['vendor']} {result['marked_passed']['model']} recorded")
    return lines


def record_report(summary: dict) -> list[str]:
    if not summary["recorded"]:
        lines = [f"kernel golden {summary['golden']}: NOT recorded: variants or thread counts disagree on this machine"]
        for d in summary["disagreements"][:20]:
            diff = d["first_difference"]
            at = (
                ""
                if diff is None
                else f"; first differing element {diff['index']}: {diff['expected']} vs {diff['got']}"
            )
            lines.append(f"  {d['section']} {d['kernel']}/{d['case']}: {', '.join(d['variants'])}{at}")
        return lines
    lines = [f"kernel golden {summary['golden']}: recorded"]
    for name, s in summary["sections"].items():
        lines.append(
            f"  {name.replace('_', '-')}: {s['cases']} cases from {s['records']} records "
            f"(variants {' '.join(s['variants'])})"
        )
    lines.append("  check it on another CPU with `titan-audit golden kernels`, then add that CPU with --mark-passed")
    return lines
