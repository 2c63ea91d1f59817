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

.PHONY: demo test setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/titan-audit demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
