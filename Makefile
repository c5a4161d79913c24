# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs attnkit, runs the main job
#   make test   creates .venv, installs attnkit with its test extras, runs every test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# constraints.txt pins torch to the CPU build 2.13.0; an unpinned torch pulls a CUDA build.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(PIP) -e '.[viz]'
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed
	$(PIP) -e '.[viz,test]'
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/tutorial.py

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) attention.png .pytest_cache .hypothesis
