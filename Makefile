# kvserve developer commands. `make install` builds .venv; everything else uses it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
TORCH_VERSION ?= 2.13.0
IMAGE ?= kvserve:dev

.PHONY: install lint test test-fast bench demo clean manifests prometheus helm-env image

install: $(VENV)/.installed

# torch is pinned to the CPU wheel that these machines carry; any other version pulls GBs of CUDA.
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# ruff first: a lint error fails in seconds, not after the suite (its rules are in pyproject.toml).
lint: install
	$(BIN)/ruff check .
	@# Markers inside a docstring or a doc pass ruff and the tests, so look for them outright.
	@! grep -rnE --exclude-dir=.git --exclude-dir=.venv --exclude-dir=build --exclude-dir=node_modules \
		--include='*.py' --include='*.md' --include='*.yaml' --include='*.yml' --include='*.json' --include='*.toml' \
		'^(<<<<<<<|>>>>>>>) ' . || { echo 'merge conflict markers above'; exit 1; }

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/offline_throughput.py

# The whole loop on this machine: runtime + agent processes, the real operator against the
# Kubernetes API emulator, a burst of streaming requests, autoscaling up and down (scripts/demo.py).
demo: install
	$(BIN)/python scripts/demo.py

# Derived deployment files (CRD copies, dashboard JSON, the chart's copies) from their sources.
manifests: install
	$(BIN)/python scripts/gen_manifests.py

# Prometheus 2.42 + promtool (Debian package unpacked into build/prometheus; tests fetch it too).
prometheus:
	$(PYTHON) scripts/prometheus_bin.py

# The real Helm engine for tests/test_helm.py: helm-sdkpy needs Python >= 3.12 (build/helm-venv).
helm-env:
	$(PYTHON) scripts/helm_render.py --ensure-env

# The one image for operator, runtime and agent (needs a Docker engine; none runs on CI).
# CPU-only build: make image DOCKER_BUILD_ARGS="--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
image:
	docker build --build-arg TORCH_VERSION=$(TORCH_VERSION) $(DOCKER_BUILD_ARGS) -t $(IMAGE) .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
