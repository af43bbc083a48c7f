# Set-up and entry points. Every target creates the virtual environment it needs (.venv).
# On a machine without a GPU, TORCH defaults to the CPU build; on a GPU machine pass e.g.
# `make verify TORCH=torch` to take the CUDA build from PyPI.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

# The torch stamp's name carries a checksum of $(TORCH) (its content, the value itself), so a new
# TORCH= value finds no stamp and reinstalls torch in the existing .venv; the same value reuses it.
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH)' | cksum | cut -d' ' -f1)

.PHONY: verify test test-long lint bench experiments paper tables clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# --force-reinstall --no-deps replaces whatever torch build is there (pip would keep a CPU build that
# satisfies `torch`); the second install adds the new build's dependencies.
$(TORCH_STAMP): | $(PY)
	rm -f $(VENV)/.torch-*
	$(PY) -m pip install -q --force-reinstall --no-deps "$(TORCH)"
	$(PY) -m pip install -q "$(TORCH)"
	printf '%s\n' '$(TORCH)' > $@

$(VENV)/.installed: pyproject.toml $(TORCH_STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The main job: every implementation against every oracle (interpreter on small cases without a GPU).
verify: $(VENV)/.installed
	$(PY) -m verify $(VERIFY_ARGS)

# The tests, on both cores (CI runs this, then test-long).
test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" $(PYTEST_ARGS)

# The interpreter's longest cases (marked slow): the same kernel paths at more sizes.
test-long: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m slow $(PYTEST_ARGS)

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
