"""The package build's one addition to pyproject.toml: compile the CPU kernel library.

`pip install .`, `pip wheel .` and `python -m build` run the `build_kernels` step, which compiles
`titan_audit/batch_invariant/cpu/kernels/*.cpp` in every ISA variant of this machine's
architecture into `titan_audit/batch_invariant/cpu/_titan_bi.so` inside the package, with the
flags of `kernel_build.py` (the same module `make kernels` runs; loaded here by path, so the build
environment needs no torch, only the system C++ compiler). An editable install (`pip install -e .`)
builds the library in place, exactly as `make kernels` does. Objects are kept in build/kernels
(shared with `make`), so a build after `make kernels` only links.

The wheel holds a native library, so it is tagged for the platform, `py3-none-<platform>` (the
library is loaded with ctypes, not as a Python extension, so any Python 3 on that platform).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
CPU_PACKAGE = ("titan_audit", "batch_invariant", "cpu")


def kernel_build():
    """titan_audit/batch_invariant/cpu/kernel_build.py, without importing titan_audit (torch)."""
    name = "_titan_audit_kernel_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT.joinpath(*CPU_PACKAGE, "kernel_build.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class BuildKernels(Command):
    """Compile the kernel library into the build (or in place for an editable install)."""

    description = "compile the batch-invariant CPU kernels (_titan_bi.so)"
    user_options = [("jobs=", "j", "parallel compiles (default: CPU count)")]

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False
        self.jobs = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_lib", "build_lib"))
        self.jobs = int(self.jobs) if self.jobs else None

    def _target(self) -> Path:
        kb = kernel_build()
        return kb.LIB_PATH if self.editable_mode else Path(self.build_lib).joinpath(*CPU_PACKAGE, kb.LIB_NAME)

    def run(self) -> None:
        kb = kernel_build()
        try:
            kb.build_library(self._target(), jobs=self.jobs)
        except kb.BuildError as error:
            raise SystemExit(str(error)) from None

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else [str(self._target())]

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class Build(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class BdistWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _python, _abi, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    """Not pure Python: the wheel carries a native library (platform build dir, platlib)."""

    def has_ext_modules(self) -> bool:
        return True


setup(
    distclass=BinaryDistribution,
    cmdclass={"build": Build, "build_kernels": BuildKernels, "bdist_wheel": BdistWheel},
)
