PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench lint clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "python3.11 not found"; exit 1; }
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
