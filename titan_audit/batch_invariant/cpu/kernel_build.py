"""Build the batch-invariant CPU kernels: the one place their compile and link flags live.

    python3 -I titan_audit/batch_invariant/cpu/kernel_build.py library            # `make kernels`
    python3 -I titan_audit/batch_invariant/cpu/kernel_build.py battery            # `make battery`
    python3 -I titan_audit/batch_invariant/cpu/kernel_build.py battery --arch aarch64 --cxx aarch64-linux-gnu-g++
    python3 -I titan_audit/batch_invariant/cpu/kernel_build.py hash | flags

Stdlib only and no torch: the Makefile runs it as a script, setup.py's build hook (`pip install .`,
`pip wheel`, `pip install -e .`) loads it by path in a build environment without torch, and the
loader (`_lib.py`) imports it for `source_hash`. (`-I` keeps this directory, which holds a
`random.py`, off sys.path; the script itself imports nothing that would pick it up.)

Guarantees:
- Every `kernels/*.cpp` is compiled once per ISA variant of the target architecture (x86_64:
  scalar, avx2, avx512; any other: scalar) with `CXXFLAGS` + `isa_flags(isa, arch)`:
  -ffp-contract=off and no fast-math keep each kernel's operation order the one in its source.
  Only the system C++ compiler is needed (no torch headers, no Python headers).
- The library links every variant into one shared object, plus a generated function
  `ta_kernels_source_hash()` returning `source_hash()`: sha256 of the build recipe for the target
  architecture (variants, flags) and of every kernel source and header. The loader compares it
  with the sources it finds, so a library built from other sources or flags is refused; an
  installed package without the sources checks the kernels version only.
- Incremental: an object is rebuilt when it is older than its source or any header, or was made
  with other flags (the command is kept in `<object>.cmd`); the library or battery is relinked
  when older than one of its inputs. Every output is written to a temporary name and renamed, so
  an interrupted build never leaves a partial file.
- A compiler that is missing or fails raises `BuildError` with the command and its output.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE / "kernels"
BATTERY_SRC = HERE / "battery" / "battery.cpp"
LIB_NAME = "_titan_bi.so"
LIB_PATH = HERE / LIB_NAME
ROOT = HERE.parents[2]  # the checkout (meaningful only there)
BUILD_DIR = ROOT / "build"
HASH_SYMBOL = "ta_kernels_source_hash"

# ---------------------------------------------------------------- the flags (the only copy)
CXXFLAGS = (
    "-std=c++17",
    "-O3",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-unused-function",
)
LDFLAGS = ("-shared", "-fopenmp")
ISA_FLAGS = {
    "scalar": ("-DTA_ISA_SCALAR",),
    "avx2": ("-DTA_ISA_AVX2", "-mavx2", "-mfma"),
    "avx512": (
        "-DTA_ISA_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mprefer-vector-width=512",
    ),
}
X86_SCALAR_FLAGS = ("-mno-fma", "-mno-avx")  # the portable variant stays portable on x86_64
ARCH_ISAS = {"x86_64": ("scalar", "avx2", "avx512")}  # any other architecture: scalar only
# The kernel battery (battery/battery.cpp, no torch): linked from the library's objects.
BATTERY_CXXFLAGS = (
    "-std=c++17",
    "-O2",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
)
CROSS_HINT = "install the arm64 cross toolchain and emulator: apt-get install -y g++-aarch64-linux-gnu qemu-user"


class BuildError(RuntimeError):
    """A compiler is missing or a compile or link step failed."""


def host_arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def isas(arch: str | None = None) -> tuple[str, ...]:
    """The ISA variants built for `arch` (default: this machine's)."""
    return ARCH_ISAS.get(arch or host_arch(), ("scalar",))


def isa_flags(isa: str, arch: str | None = None) -> tuple[str, ...]:
    arch = arch or host_arch()
    if isa not in isas(arch):
        raise ValueError(f"kernel build: no {isa!r} variant on {arch} (it has {', '.join(isas(arch))})")
    return ISA_FLAGS[isa] + (X86_SCALAR_FLAGS if isa == "scalar" and arch == "x86_64" else ())


def recipe(arch: str | None = None) -> dict:
    """What the library of `arch` is built with (hashed into it)."""
    arch = arch or host_arch()
    return {
        "arch": arch,
        "cxxflags": list(CXXFLAGS),
        "isas": {isa: list(isa_flags(isa, arch)) for isa in isas(arch)},
        "ldflags": list(LDFLAGS),
    }


def sources(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    return sorted(kernel_dir.glob("*.cpp"))


def inputs(kernel_dir: Path = KERNEL_DIR) -> list[Path]:
    """The kernel sources and headers (empty where they are not shipped, e.g. an installed wheel)."""
    return sorted(p for p in kernel_dir.glob("*") if p.suffix in (".cpp", ".h") and p.is_file())


def source_hash(kernel_dir: Path = KERNEL_DIR, arch: str | None = None) -> str:
    """sha256 (hex) of the recipe for `arch` and of every kernel source and header (name and bytes)."""
    h = hashlib.sha256(json.dumps(recipe(arch), sort_keys=True).encode())
    for path in inputs(kernel_dir):
        h.update(b"\0" + path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# ---------------------------------------------------------------- building


def _cxx(cxx: str | Sequence[str] | None) -> list[str]:
    if cxx is None:
        cxx = os.environ.get("CXX") or "g++"
    command = shlex.split(cxx) if isinstance(cxx, str) else list(cxx)
    return command


def _shown(command: list[str]) -> str:
    """The command as printed: paths under the working directory relative to it."""
    cwd = os.getcwd() + os.sep
    return shlex.join(a[len(cwd) :] if a.startswith(cwd) else a for a in command)


def _run(command: list[str], quiet: bool) -> None:
    if not quiet:
        print(_shown(command), flush=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError(f"kernel build: the C++ compiler {command[0]!r} was not found (install g++)") from None
    if proc.stdout or proc.stderr:
        print((proc.stdout + proc.stderr).rstrip(), file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise BuildError(f"kernel build: `{shlex.join(command)}` exited {proc.returncode}:\n{proc.stderr[-4000:]}")


def _record(out: Path) -> Path:
    return out.with_name(out.name + ".cmd")


def _stale(out: Path, deps: Sequence[Path], command: list[str] | None = None) -> bool:
    """`out` is missing or older than one of `deps`, or (with `command`) was made by another command
    (its flags changed: recorded in `<out>.cmd`, so editing this file's prose rebuilds nothing)."""
    if not out.exists():
        return True
    if command is not None and (not _record(out).exists() or _record(out).read_text() != shlex.join(command)):
        return True
    built = out.stat().st_mtime
    return any(d.stat().st_mtime > built for d in deps)


def _produce(command: list[str], out: Path, quiet: bool, record: bool = False) -> None:
    """Run `command -o <tmp>` and rename the result to `out` (nothing left behind on failure);
    `record`: write the command to `<out>.cmd` for `_stale`."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        _run([*command, "-o", str(tmp)], quiet)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    if record:
        _record(out).write_text(shlex.join(command))


def compile_objects(
    build_dir: Path,
    *,
    cxx: str | Sequence[str] | None = None,
    arch: str | None = None,
    jobs: int | None = None,
    quiet: bool = False,
) -> list[Path]:
    """Every kernel source in every variant of `arch`, as `build_dir/<stem>.<isa>.o` (rebuilt when stale)."""
    arch = arch or host_arch()
    srcs = sources()
    if not srcs:
        raise BuildError(f"kernel build: no kernel sources in {KERNEL_DIR}")
    headers = [p for p in inputs() if p.suffix == ".h"]
    compiler = _cxx(cxx)
    build_dir.mkdir(parents=True, exist_ok=True)
    todo, objects = [], []
    for isa in isas(arch):
        for src in srcs:
            obj = build_dir / f"{src.stem}.{isa}.o"
            objects.append(obj)
            command = [*compiler, *CXXFLAGS, *isa_flags(isa, arch), "-c", str(src)]
            if _stale(obj, [src, *headers], command):
                todo.append((command, obj))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        for future in [pool.submit(_produce, command, obj, quiet, True) for command, obj in todo]:
            future.result()
    return objects


def build_library(
    out: Path = LIB_PATH,
    build_dir: Path = BUILD_DIR / "kernels",
    *,
    cxx: str | Sequence[str] | None = None,
    jobs: int | None = None,
    quiet: bool = False,
) -> Path:
    """The shared library of every variant of this machine's architecture, at `out`."""
    objects = compile_objects(build_dir, cxx=cxx, jobs=jobs, quiet=quiet)
    stub = build_dir / "ta_source_hash.cpp"
    text = (
        "// generated by kernel_build.py: what the library was built from (checked by _lib.py)\n"
        f'extern "C" __attribute__((visibility("default"))) const char* {HASH_SYMBOL}() '
        f'{{ return "{source_hash()}"; }}\n'
    )
    if not stub.exists() or stub.read_text() != text:
        stub.write_text(text)
    stub_obj = stub.with_suffix(".o")
    command = [*_cxx(cxx), *CXXFLAGS, *isa_flags("scalar"), "-c", str(stub)]
    if _stale(stub_obj, [stub], command):
        _produce(command, stub_obj, quiet, record=True)
    linked = [*objects, stub_obj]  # a change of LDFLAGS changes the source hash, so the stub: relinked
    if _stale(out, linked):
        out.parent.mkdir(parents=True, exist_ok=True)
        _produce([*_cxx(cxx), *LDFLAGS, *map(str, linked)], out, quiet)
    return out


def build_battery(
    arch: str | None = None,
    *,
    cxx: str | Sequence[str] | None = None,
    build_dir: Path | None = None,
    out: Path | None = None,
    jobs: int | None = None,
    quiet: bool = False,
) -> Path:
    """The kernel battery linked from the kernels' objects: natively (`build/battery/battery`) or
    for another architecture (`build/<arch>/battery`, linked statically so qemu-user runs it)."""
    native = arch is None or arch == host_arch()
    arch = arch or host_arch()
    if native:
        build_dir = build_dir or BUILD_DIR / "kernels"
        out = out or BUILD_DIR / "battery" / "battery"
    else:
        build_dir = build_dir or BUILD_DIR / arch / "kernels"
        out = out or BUILD_DIR / arch / "battery"
        compiler = _cxx(cxx)
        try:
            subprocess.run([*compiler, "--version"], capture_output=True, check=False)
        except FileNotFoundError:
            raise BuildError(f"kernel build: {compiler[0]} not found; {CROSS_HINT}") from None
    objects = compile_objects(build_dir, cxx=cxx, arch=arch, jobs=jobs, quiet=quiet)
    command = [*_cxx(cxx), *BATTERY_CXXFLAGS, *([] if native else ["-static"]), str(BATTERY_SRC), *map(str, objects)]
    if _stale(out, [BATTERY_SRC, *objects], command):
        out.parent.mkdir(parents=True, exist_ok=True)
        _produce(command, out, quiet, record=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel_build.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    lib = sub.add_parser("library", help=f"the kernel library (default {LIB_PATH})")
    lib.add_argument("--out", type=Path, default=LIB_PATH)
    lib.add_argument("--build-dir", type=Path, default=BUILD_DIR / "kernels", help="where the objects go")
    battery = sub.add_parser("battery", help="the kernel battery harness")
    battery.add_argument("--arch", default=None, help="target architecture (default: this machine's)")
    battery.add_argument("--out", type=Path, default=None)
    battery.add_argument("--build-dir", type=Path, default=None)
    for p in (lib, battery):
        p.add_argument("--cxx", default=None, help="the C++ compiler (default $CXX or g++)")
        p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
        p.add_argument("-q", "--quiet", action="store_true")
    sub.add_parser("hash", help="the source hash a library built now carries")
    flags = sub.add_parser("flags", help="the build recipe (JSON)")
    flags.add_argument("--arch", default=None)
    args = parser.parse_args(argv)
    try:
        if args.what == "library":
            build_library(args.out, args.build_dir, cxx=args.cxx, jobs=args.jobs, quiet=args.quiet)
        elif args.what == "battery":
            build_battery(
                args.arch, cxx=args.cxx, build_dir=args.build_dir, out=args.out, jobs=args.jobs, quiet=args.quiet
            )
        elif args.what == "hash":
            print(source_hash())
        else:
            print(json.dumps(recipe(args.arch), indent=1))
    except (BuildError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
