# kvserve: `make serve` and `make test` work on a machine with only Python 3.11+ and pip.
# The virtual environment is created on first use and reinstalled when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
# torch is installed first, pinned: a plain `torch` requirement may pull a CUDA build (GBs).
# Where pip sees PyPI alone (its Linux wheel bundles CUDA 13's libraries), the CPU-only build:
#   make TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
BENCH_ARGS ?=
SERVE_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-installed
PIP_INSTALL := $(BIN)/python -m pip install $(if $(CI),--progress-bar off)

.PHONY: serve test protos bench-kvcache bench-throughput bench-front bench-gateway install clean distclean

# The whole stack on the built-in tiny model: manager on 127.0.0.1:50061, model service on :50051.
serve: $(STAMP)
	$(BIN)/kvserve up --model tiny $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

bench-kvcache: $(STAMP)
	$(BIN)/python bench/kvcache_bench.py $(BENCH_ARGS)

bench-throughput: $(STAMP)
	$(BIN)/python bench/throughput.py $(BENCH_ARGS)

# What TLS, mutual TLS, API keys and the HTTP front cost a request, against plaintext gRPC.
bench-front: $(STAMP)
	$(BIN)/python bench/front_bench.py $(BENCH_ARGS)

# The gateway's routing against round-robin and random, with real workers.
bench-gateway: $(STAMP)
	$(BIN)/python bench/gateway_bench.py $(BENCH_ARGS)

install: $(STAMP)

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "kvserve needs Python 3.11 or newer; '$(PYTHON)' is: $$($(PYTHON) --version 2>&1)." >&2; \
	  echo "Point PYTHON at one, e.g.: make PYTHON=python3.12 test" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)

# Top-level package __init__.py files count too: an editable install maps the
# top-level packages that exist when it runs.
# The native kernels are compiled by the install: a changed C file, header or level list reinstalls.
$(STAMP): pyproject.toml setup.py $(wildcard */__init__.py) $(wildcard model_service/kernels/*.c) $(wildcard model_service/kernels/*.h) model_service/kernels/levels.py | $(BIN)/python
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) $(TORCH_SPEC)
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
	rm -f model_service/kernels/_*.so
