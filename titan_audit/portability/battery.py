"""Run the kernel battery (`batch_invariant/cpu/battery/battery.cpp`, built by `make battery` or,
for arm64 under qemu-user, `make battery-aarch64`) and hash what it writes.

Guarantees:
- `run_cases(arch)` yields one `CaseOutputs` per (kernel, case) in the harness's order: every
  (variant, threads) record of that case with the xxh3-128 hex digest of its raw output bytes,
  its dtype and element count, and the bytes themselves (a case's records arrive together and only
  one case is held at a time). The inputs are made from integers inside the harness, so a record
  depends on the kernels alone, never on torch's RNG or the ISA.
- Nothing is ever silently skipped or faked: a missing harness, one older than a kernel source or
  battery.cpp (not rebuilt), a missing emulator, a harness that exits non-zero or a truncated or
  malformed stream raises `ValueError` saying what to run. Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[2]
CPU_DIR = ROOT / "titan_audit" / "batch_invariant" / "cpu"
KERNEL_DIR = CPU_DIR / "kernels"
BATTERY_SRC = CPU_DIR / "battery" / "battery.cpp"
HARNESS = {"native": ROOT / "build" / "battery" / "battery", "aarch64": ROOT / "build" / "aarch64" / "battery"}
MAKE_TARGET = {"native": "battery", "aarch64": "battery-aarch64"}
ARCHES = tuple(HARNESS)
CROSS_INSTALL = "apt-get install -y g++-aarch64-linux-gnu qemu-user"
QEMU = ("qemu-aarch64", "qemu-aarch64-static")
MAGIC = b"TABATTERY 1\n"
DTYPES = {"f32": np.dtype("<f4"), "f64": np.dtype("<f8"), "i64": np.dtype("<i8")}
_BITS = {"f32": np.dtype("<u4"), "f64": np.dtype("<u8"), "i64": np.dtype("<u8")}


def digest(data: bytes) -> str:
    """The hash the kernel golden keeps for one record: xxh3-128 (hex) of its raw bytes."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass
class Record:
    variant: str
    threads: int  # 0: the kernel takes no thread count
    digest: str
    data: bytes


@dataclass
class CaseOutputs:
    """Every record of one (kernel, case)."""

    kernel: str
    case: str
    dtype: str
    count: int
    records: list[Record] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.kernel}/{self.case}"


@dataclass(frozen=True)
class Difference:
    """The first element where two records of one case differ."""

    index: int
    expected: str
    got: str
    expected_bits: str
    got_bits: str

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "expected": self.expected,
            "got": self.got,
            "expected_bits": self.expected_bits,
            "got_bits": self.got_bits,
        }


def first_difference(dtype: str, expected: bytes, got: bytes) -> Difference | None:
    """The first differing element of two records (by bits), or None when they are equal."""
    bits = _BITS[dtype]
    a, b = np.frombuffer(expected, bits), np.frombuffer(got, bits)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size == 0:
        if a.size == b.size:
            return None
        i = n  # one is a prefix of the other
        return Difference(i, _value(dtype, a, i), _value(dtype, b, i), _hex(a, i), _hex(b, i))
    i = int(diff[0])
    return Difference(i, _value(dtype, a, i), _value(dtype, b, i), _hex(a, i), _hex(b, i))


def _value(dtype: str, bits: np.ndarray, i: int) -> str:
    if i >= bits.size:
        return "(absent)"
    return repr(bits[i : i + 1].view(DTYPES[dtype])[0].item())


def _hex(bits: np.ndarray, i: int) -> str:
    if i >= bits.size:
        return "-"
    return f"0x{int(bits[i]):0{bits.itemsize * 2}x}"


# ---------------------------------------------------------------- the harness


def sources() -> list[Path]:
    """What the harness is built from: the kernel sources and headers and battery.cpp."""
    found = [p for p in KERNEL_DIR.iterdir() if p.suffix in (".cpp", ".h")] if KERNEL_DIR.is_dir() else []
    return sorted(found) + [BATTERY_SRC]


def harness(arch: str = "native") -> Path:
    """The built harness for `arch`; ValueError (what to run) when it is missing or stale."""
    if arch not in HARNESS:
        raise ValueError(f"unknown battery architecture {arch!r}; choose from {', '.join(ARCHES)}")
    path, target = HARNESS[arch], MAKE_TARGET[arch]
    hint = f"build it with `make {target}` in {ROOT}" + (f" (needs: {CROSS_INSTALL})" if arch == "aarch64" else "")
    if not path.exists():
        raise ValueError(f"kernel battery: {path} is missing; {hint}")
    built = path.stat().st_mtime
    stale = [p.name for p in sources() if p.exists() and p.stat().st_mtime > built]
    if stale:
        raise ValueError(f"kernel battery: {path} is older than its sources ({', '.join(stale)}); {hint}")
    return path


def emulator() -> str:
    """The qemu-user binary that runs the arm64 harness; ValueError with the install command."""
    for name in QEMU:
        found = shutil.which(name)
        if found:
            return found
    raise ValueError(
        f"kernel battery: qemu-aarch64 not found (the arm64 battery runs under qemu-user); {CROSS_INSTALL}"
    )


def command(arch: str = "native") -> list[str]:
    """The command line that runs the harness of `arch` on this machine."""
    path = str(harness(arch))
    return [emulator(), path] if arch == "aarch64" else [path]


def variants(arch: str = "native") -> list[str]:
    """The ISA variants the harness of `arch` runs on this machine (narrowest first)."""
    out = subprocess.run([*command(arch), "--variants"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ValueError(f"kernel battery: {' '.join(command(arch))} --variants failed: {out.stderr.strip()}")
    return out.stdout.split()


def run_cases(
    arch: str = "native", *, only: str | None = None, threads: tuple[int, ...] = (1, 2)
) -> Iterator[CaseOutputs]:
    """Run the battery and yield its cases (see the module doc). `only`: cases whose
    "kernel/case" starts with it."""
    cmd = [*command(arch), "--threads", ",".join(map(str, threads))]
    if only:
        cmd += ["--only", only]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        yield from _parse(proc.stdout, " ".join(cmd))
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        code = proc.wait()
    if code != 0:
        raise ValueError(f"kernel battery: `{' '.join(cmd)}` exited with {code}: {err[-500:]}")


def _parse(stream, name: str) -> Iterator[CaseOutputs]:  # noqa: ANN001
    def bad(what: str) -> ValueError:
        return ValueError(f"kernel battery: malformed output of `{name}`: {what}")

    if stream.readline() != MAGIC:
        raise bad("no TABATTERY 1 header")
    group: tuple[str, str] | None = None  # (kernel, case before its ".part"): its records come together
    current: dict[str, CaseOutputs] = {}
    records = 0
    while True:
        line = stream.readline()
        if not line:
            raise bad("the stream ends before its END line (the harness crashed?)")
        fields = line.decode(errors="replace").split()
        if fields and fields[0] == "END":
            if len(fields) != 2 or int(fields[1]) != records:
                raise bad(f"END says {fields[1:]} records, {records} were read")
            break
        if len(fields) != 7 or fields[0] != "R" or fields[5] not in DTYPES:
            raise bad(f"unexpected line {line[:120]!r}")
        _, kernel, case, variant, threads, dtype, count = fields
        n = int(count) * DTYPES[dtype].itemsize
        data = stream.read(n)
        if len(data) != n:
            raise bad(f"record {kernel}/{case} is truncated ({len(data)} of {n} bytes)")
        records += 1
        if (kernel, case.split(".", 1)[0]) != group:
            yield from current.values()
            group, current = (kernel, case.split(".", 1)[0]), {}
        out = current.get(case)
        if out is None:
            out = current[case] = CaseOutputs(kernel, case, dtype, int(count))
        elif (out.dtype, out.count) != (dtype, int(count)):
            raise bad(f"{kernel}/{case}: {variant} wrote {count} {dtype}, another variant {out.count} {out.dtype}")
        out.records.append(Record(variant, int(threads), digest(data), data))
    yield from current.values()
