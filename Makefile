# Any Python 3 from 3.11 on: python3.11 where the host has it (torch's CPU wheel lies on disk for it), else python3.
PY ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The repository's folders install as sluice.*; the working directory on sys.path would put its kernels/ folder
# in place of Hugging Face's `kernels` distribution, which transformers imports.
export PYTHONSAFEPATH := 1

.PHONY: demo test install bench lint clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		echo "Sluice needs Python >= 3.11; '$(PY)' is $$($(PY) --version 2>&1 || echo missing). Run: make PY=python3.12"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sluice.producer.demo

test: $(STAMP)
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server not found: apt-get install redis-server"; exit 1; }
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

lint: $(STAMP)
	$(BIN)/ruff check engine kernels contract producer worker cli tests bench

clean:
	rm -rf $(VENV) results
