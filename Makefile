# moekit: `make test` sets up .venv and runs the test suite; `make demo` runs the main job.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) scripts/demo_moe.py

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP) install -c constraints.txt -e ".[dev,bench]"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) scripts/bench_moe.py

clean:
	rm -rf $(VENV) .pytest_cache
