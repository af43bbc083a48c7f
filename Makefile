# Set-up and entry points. Every target creates the virtual environment it needs (.venv).
# On a machine without a GPU, TORCH defaults to the CPU build; on a GPU machine pass e.g.
# `make verify TORCH=torch` to take the CUDA build from PyPI.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: verify test lint bench experiments paper tables clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The main job: every implementation against every oracle (interpreter on small cases without a GPU).
verify: $(VENV)/.installed
	$(PY) -m verify $(VERIFY_ARGS)

# The tests (CI runs exactly this).
test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

# GPU only: the kernel benchmark and the ablations.
bench: $(VENV)/.installed
	$(PY) -m experiments bench --sweep

experiments: $(VENV)/.installed
	$(PY) -m experiments run

# The paper: tables and figures from committed results, then LaTeX to PDF.
tables: $(VENV)/.installed
	$(PY) -m paper.generate

paper: tables
	bash paper/build.sh

clean:
	rm -rf $(VENV) paper/build
