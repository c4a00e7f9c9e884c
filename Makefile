# moekit: `make train` sets up .venv and the data and runs the main job; `make test` runs the test suite (what CI
# runs), `make test-fast` its unit and config tier (no test that fits a model or starts processes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install test test-fast lint train demo bench bench-models gpu-bundle gpu-check clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -n auto --dist worksteal

test-fast: install
	$(PY) -m pytest -q -n auto --dist worksteal -m "not e2e and not soak"

lint: install
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts

train: install data allocator
	$(PY) scripts/train.py experiment=soft_moe_vit

demo: install
	$(PY) scripts/demo_moe.py

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP) install -c constraints.txt -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) scripts/bench_moe.py

bench-models: install
	$(PY) scripts/bench_models.py

clean:
	rm -rf $(VENV) .pytest_cache

# Fashion-MNIST for the default data config: the Debian package puts the 4 IDX files in FASHION_MNIST_DIR.
FASHION_MNIST_DIR := /usr/share/datasets/fashion-mnist
.PHONY: data
data:
	@if [ ! -f $(FASHION_MNIST_DIR)/train-images-idx3-ubyte.gz ]; then \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		echo "Installing dataset-fashion-mnist (files go to $(FASHION_MNIST_DIR))"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist \
		|| { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist; }; \
	fi

# The GPU check, on a CUDA machine without network (docs/performance.md#gpu). `make gpu-bundle` here, with network:
# Fashion-MNIST into data/fashion-mnist/ and wheels of the pure-Python packages a CUDA image with PyTorch, timm and
# Lightning lacks (and soft-moe-pytorch, the layer tables' reference) into .whl/ (both ignored by git: carry them); then
# `make gpu-check` there, with the image's python3.
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 soft-moe-pytorch==0.1.9 einops==0.8.2
gpu-bundle: install data
	mkdir -p data/fashion-mnist .whl
	cp -u $(FASHION_MNIST_DIR)/*-ubyte.gz data/fashion-mnist/
	$(PIP) wheel -q --no-deps -w .whl $(GPU_WHEELS)
	@du -sh data/fashion-mnist .whl

gpu-check:
	bash scripts/gpu_check.sh

# tcmalloc, which every script restarts itself with (moekit.utils.allocator; MOEKIT_ALLOCATOR=system opts out): large
# expert gradients page-fault on every step under glibc's defaults. Best effort: without it moekit tunes glibc's malloc.
.PHONY: allocator
allocator:
	@if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		echo "Installing libtcmalloc-minimal4 (the scripts run with tcmalloc: faster MoE training on CPUs)"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 \
		|| echo "could not install libtcmalloc-minimal4; the scripts tune glibc's malloc instead"; \
	fi
