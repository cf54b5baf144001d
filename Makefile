# The commands of the README: `make demo`, `make test`, `make lint` and `make venv`.
# Each creates (or reuses) a local virtual environment with pinned dependencies;
# afterwards .venv/bin/hybridserve and .venv/bin/python run everything else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m hybridserve.cli demo

lint: $(STAMP)
	$(PY) -m ruff check .

# TRITON_INTERPRET=1 runs Triton kernels on the CPU (the race checker needs it).
test: $(STAMP)
	$(PY) -m ruff check .
	TRITON_INTERPRET=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV)
