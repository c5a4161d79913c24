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

.PHONY: demo test test-torch test-native-builds lint docs wheel fuzz bench tutorial clean
LINTED := src tests benchmarks examples scripts docs/hooks.py

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(PIP) -e '.[viz,models]'
	$(PIP) --no-deps recbole==1.2.1  # only for MovieLens-100K's files, read without importing recbole
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed
	$(PIP) -e '.[viz,models,hf,test,gpu,docs,lint]'
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

# the suite on the newest torch attnkit supports (2.14.1: a CUDA build, run on the CPU), in a venv of its own,
# with the native engine turned off: the PyTorch engines, what a machine without a C++ compiler runs
TORCH_NEXT ?= 2.14.1
VENV_NEXT := .venv-torch
$(VENV_NEXT)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install --quiet --disable-pip-version-check torch==$(TORCH_NEXT)
	grep -v '^torch==' constraints.txt > $(VENV_NEXT)/constraints.txt
	$(VENV_NEXT)/bin/python -m pip install --quiet --disable-pip-version-check -c $(VENV_NEXT)/constraints.txt \
		-e '.[viz,models,hf,test]'  # no [gpu]: torch 2.14.1 brings its own Triton (3.8)
	$(VENV_NEXT)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps recbole==1.2.1
	touch $@

# what the first pass leaves to make test (CI time): the engine's builds for other CPUs (the same
# compiler either way), the figures and the browser (matplotlib and Chromium, no attention kernel),
# the docs' examples (make test runs them; make docs builds the pages)
NOT_ON_TORCH_NEXT := -k "not vector_widths" --ignore=tests/viz --ignore=tests/test_docs.py
test-torch: $(VENV_NEXT)/.installed
	$(VENV_NEXT)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH_NEXT)'), torch.__version__"
	ATTNKIT_NATIVE=0 $(VENV_NEXT)/bin/python -m pytest -q -p no:cacheprovider $(NOT_ON_TORCH_NEXT)
	$(VENV_NEXT)/bin/python -m pytest -q -p no:cacheprovider tests/kernels/test_native.py tests/kernels/test_native_build.py \
		-k "not damaged and not vector_widths"  # the engine built against this torch (the build's own checks: make test)

# the native engine's tests on the builds of other CPUs than this one, in caches of their own:
# AVX2 (x86-64-v3: 8 floats a vector, bfloat16 widened to float32) and AVX-512 without AVX512-BF16
# (x86-64-v4); on a CPU with AMX, the AVX512-BF16 dot products too (ATTNKIT_NATIVE_AMX=0; the
# default build takes the tiles there); a subset under AddressSanitizer and UndefinedBehaviorSanitizer
# (their runtimes preloaded into Python; any report ends the run)
NATIVE_TESTS := tests/kernels/test_native.py tests/kernels/test_nan.py
SANITIZED := tests/kernels/test_native.py -k "every_mask or score_modifications or awkward or junk or rows_that_see"
test-native-builds: export ATTNKIT_REQUIRE_NATIVE = 1
test-native-builds: $(VENV)/.test-installed
	@if [ "$$(uname -m)" = x86_64 ]; then \
		ATTNKIT_NATIVE_ARCH=x86-64-v3 ATTNKIT_CACHE=build/native-v3 $(BIN)/python -m pytest -q -p no:cacheprovider $(NATIVE_TESTS) || exit 1; \
		if grep -qw avx512f /proc/cpuinfo; then \
			ATTNKIT_NATIVE_ARCH=x86-64-v4 ATTNKIT_CACHE=build/native-v4 $(BIN)/python -m pytest -q -p no:cacheprovider tests/kernels/test_native.py || exit 1; \
		fi; \
		if grep -qw amx_bf16 /proc/cpuinfo; then \
			ATTNKIT_NATIVE_AMX=0 $(BIN)/python -m pytest -q -p no:cacheprovider tests/kernels/test_native.py || exit 1; \
		fi; \
	fi
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		ATTNKIT_NATIVE_SANITIZE=address,undefined ATTNKIT_CACHE=build/native-sanitized \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(SANITIZED)

# ruff (rules in pyproject.toml) and mypy over src/attnkit
lint: $(VENV)/.test-installed
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# the documentation site into site/ (offline; warnings are errors)
docs: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the wheel, installed non-editable into a fresh venv outside the repository: the quick start
# with no extras, then `attnkit show` with [viz,models]
WHEEL_DIR := $(abspath build/wheel-check)
wheel: $(VENV)/.test-installed
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(BIN)/python -m build --wheel --outdir $(WHEEL_DIR)/dist . >/dev/null
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(WHEEL_DIR)/venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt $(WHEEL_DIR)/dist/*.whl
	cd $(WHEEL_DIR) && venv/bin/python $(CURDIR)/scripts/quick_start.py
	$(WHEEL_DIR)/venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt "$$(ls $(WHEEL_DIR)/dist/*.whl)[viz,models]"
	cd $(WHEEL_DIR) && venv/bin/attnkit show "The cat sat." --out shown && test -s shown/attention.html

# make fuzz FUZZ_MINUTES=10: the fuzz suite (tests/fuzz) with fresh seeds until the time is up
FUZZ_MINUTES ?= 10
fuzz: $(VENV)/.test-installed
	$(BIN)/python tests/fuzz/run.py --minutes $(FUZZ_MINUTES)

bench: $(VENV)/.demo-installed
	$(BIN)/python benchmarks/cpu.py

clean:
	rm -rf $(VENV) $(VENV_NEXT) attention attention.png .pytest_cache .hypothesis site build
