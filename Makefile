# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs attnkit, runs the main job (attnkit show, translate, caption, recommend, listen)
#   make test   creates .venv, installs attnkit with its test extras, runs every test
# and one more measures speed: make bench (benchmarks/cpu.py; long); make fuzz fuzzes (10 minutes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# constraints.txt pins torch to the CPU build 2.13.0; an unpinned torch pulls a CUDA build.
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
SENTENCE := The animal didn't cross the street because it was too tired.

.PHONY: demo test fuzz bench tutorial clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(PIP) -e '.[viz,models]'
	$(PIP) --no-deps recbole==1.2.1  # only for MovieLens-100K's files, read without importing recbole
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed
	$(PIP) -e '.[viz,models,hf,test,gpu]'
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/attnkit show "$(SENTENCE)" --out attention
	$(BIN)/attnkit translate "25th of March 2019" --out attention/translation
	$(BIN)/attnkit caption --digits 7,3,1 --out attention/caption
	$(BIN)/attnkit recommend --user 1 --out attention/recommend
	$(BIN)/attnkit show --model recall --length 16384 --out attention/long
	$(BIN)/attnkit listen --example 1 --out attention/listen
	$(BIN)/python -m attnkit.viz.gallery attention

tutorial: $(VENV)/.demo-installed
	$(BIN)/python examples/tutorial.py

test: $(VENV)/.test-installed
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		echo "NOTE: no chromium/chromedriver on PATH: the browser tests will be skipped (apt-get install chromium chromium-driver)"
	$(BIN)/python -m pytest

# make fuzz FUZZ_MINUTES=10: the fuzz suite (tests/fuzz) with fresh seeds until the time is up
FUZZ_MINUTES ?= 10
fuzz: $(VENV)/.test-installed
	$(BIN)/python tests/fuzz/run.py --minutes $(FUZZ_MINUTES)

bench: $(VENV)/.demo-installed
	$(BIN)/python benchmarks/cpu.py

clean:
	rm -rf $(VENV) attention attention.png .pytest_cache .hypothesis
