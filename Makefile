# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs attnkit, runs the main job (attnkit show, translate, caption, recommend, listen)
#   make test   creates .venv, installs attnkit with its test extras, runs every test
# and one more measures speed: make bench (benchmarks/cpu.py; long); make fuzz fuzzes (10 minutes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# constraints.txt pins torch to 2.13.0; scripts/install_torch.py installs its CPU build (from PyTorch's
# CPU index where the package index would give the CUDA build: TORCH_INDEX names another mirror).
# pip's own progress (what it collects, downloads and installs) shows while the set-up runs
PIP := $(BIN)/python -m pip install --disable-pip-version-check -c constraints.txt
TORCH := 2.13.0
SENTENCE := The animal didn't cross the street because it was too tired.

.PHONY: demo test test-torch test-native-builds resolve lint docs wheel wheel-only wheel-standard fuzz bench tutorial clean
LINTED := src tests benchmarks examples scripts docs/hooks.py setup.py build_backend

# a stock venv's pip may be older than the set-up needs (Ubuntu 22.04 gives 22.0.2; --dry-run --report
# came in 22.2): brought to 23.1 or newer first, only where it is older
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	@echo "make: $(VENV) has pip $$($(BIN)/python -m pip --version | cut -d' ' -f2); the set-up needs pip 23.1 or newer"
	$(BIN)/python -m pip install --disable-pip-version-check "pip>=23.1"

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml constraints.txt
	@echo "make: setting up $(VENV) (once, a few minutes): PyTorch $(TORCH) (CPU build), attnkit with [viz,models]"
	@echo "      (matplotlib, safetensors, tokenizers, scikit-learn, librosa, the MiniLM weights) and MovieLens-100K"
	$(BIN)/python scripts/install_torch.py $(TORCH) -c constraints.txt
	$(PIP) -e '.[viz,models]'
	$(PIP) --no-deps --no-warn-conflicts recbole==1.2.1  # only for MovieLens-100K's files, read without importing recbole
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed
	@echo "make: adding the test, docs and lint tools to $(VENV) (pytest, hypothesis, selenium, transformers, triton, mkdocs, ruff, mypy)"
	$(PIP) --no-warn-conflicts -e '.[viz,models,hf,test,gpu,docs,lint]'  # recbole's own dependencies are not wanted
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
	$(BIN)/python examples/tutorial.py --out attention

# the suite in parallel (pytest-xdist): one worker per core, one thread each (tests/conftest.py)
TEST_WORKERS ?= auto
test: $(VENV)/.test-installed
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		echo "NOTE: no chromium/chromedriver on PATH: the browser tests will be skipped (apt-get install chromium chromium-driver)"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# the suite on the newest torch attnkit supports (2.14.1: a CUDA build, run on the CPU), in a venv of its own,
# with the native engine turned off: the PyTorch engines, what a machine without a C++ compiler runs
TORCH_NEXT ?= 2.14.1
VENV_NEXT := .venv-torch
$(VENV_NEXT)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python scripts/install_torch.py $(TORCH_NEXT)
	grep -v '^torch==' constraints.txt > $(VENV_NEXT)/constraints.txt
	$(VENV_NEXT)/bin/python -m pip install --quiet --disable-pip-version-check -c $(VENV_NEXT)/constraints.txt \
		-e '.[viz,models,hf,test]'  # no [gpu]: torch 2.14.1 brings its own Triton (3.8)
	$(VENV_NEXT)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts recbole==1.2.1
	touch $@

# what the first pass leaves to make test (CI time): the engine's builds for other CPUs and its cache
# (the same compiler and files either way), the figures and the browser (matplotlib and Chromium, no
# attention kernel), the docs' examples (make test runs them; make docs builds the pages), the
# architecture tests (they read attnkit's source, the same on any torch), the trained applications and
# the CLI (their attention is the kernels' own, tested here), the packaging checks, the fuzz properties'
# small CI budget, the learnable biases' gradchecks and the fresh-process first calls (a subprocess each; the
# compiled paths on this torch stay: tests/integrations/test_flex_compile.py, tests/kernels/test_compile.py);
# of the ring (gloo processes, several per test) the two-rank forward and one backward stay, the other world
# sizes and the failure cases are make test's
RING := tests/ring/test_ring.py::
NOT_ON_TORCH_NEXT := -k "not vector_widths" --ignore=tests/viz --ignore=tests/test_docs.py \
	--ignore=tests/test_architecture.py --ignore=tests/apps --ignore=tests/test_package.py --ignore=tests/fuzz \
	--ignore=tests/kernels/test_native_build.py --ignore=tests/kernels/test_native_store.py --ignore=tests/test_bias.py \
	--ignore=tests/test_first_calls.py \
	--deselect "$(RING)test_ring_equals_single_process[1]" --deselect "$(RING)test_ring_equals_single_process[3]" \
	--deselect "$(RING)test_ring_equals_single_process[4]" --deselect $(RING)test_dead_rank_gives_clear_error_on_the_others \
	--deselect $(RING)test_ranks_that_disagree_are_refused_up_front --deselect $(RING)test_two_process_example_runs_under_torchrun \
	--deselect "$(RING)test_ring_backward_runs_through_the_registry_on_the_forward_plans[document_causal]"

test-torch: $(VENV_NEXT)/.installed
	$(VENV_NEXT)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH_NEXT)'), torch.__version__"
	ATTNKIT_NATIVE=0 $(VENV_NEXT)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal \
		$(NOT_ON_TORCH_NEXT)
	$(VENV_NEXT)/bin/python -m pytest -q -p no:cacheprovider tests/kernels/test_native.py tests/kernels/test_native_build.py \
		-k "not damaged and not vector_widths"  # the engine built against this torch (the build's own checks: make test)

# the native engine's other builds on this CPU: on a CPU with AMX, the AVX512-BF16 dot products
# (ATTNKIT_NATIVE_AMX=0; the default build takes the tiles there); a subset under AddressSanitizer
# and UndefinedBehaviorSanitizer (their runtimes preloaded into Python; any report ends the run).
# The AVX2 (x86-64-v3) and AVX-512 (x86-64-v4) builds are tested by make wheel, on the wheel's own.
SANITIZED := tests/kernels/test_native.py tests/test_predicate_programs.py \
	-k "every_mask or score_modifications or awkward or past_the_caches or junk or rows_that_see or semantics or packed_bits or checks_the_program or cannot_compute or (one_run_of_keys and (plain or softcap)) or split_between_threads or every_regime or past_each_length"
test-native-builds: export ATTNKIT_REQUIRE_NATIVE = 1
test-native-builds: $(VENV)/.test-installed
	@if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then \
		ATTNKIT_NATIVE_AMX=0 $(BIN)/python -m pytest -q -p no:cacheprovider tests/kernels/test_native.py || exit 1; \
	fi
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		ATTNKIT_NATIVE_SANITIZE=address,undefined ATTNKIT_CACHE=build/native-sanitized \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(SANITIZED)

# every extra resolves together with each torch release attnkit supports, as a user's pip sees them on the
# public index (Linux: the CUDA builds, each pinning its own Triton): pip install --dry-run, nothing
# installed; this machine's pip configuration (local wheels, caps) left out
RESOLVE_TORCH := 2.13.0 2.14.1 2.15.0
resolve: $(BIN)/python
	@mkdir -p build
	@echo "make resolve: attnkit[all extras] beside torch $(RESOLVE_TORCH) on https://pypi.org/simple (dry runs)"
	@echo $(RESOLVE_TORCH) | tr ' ' '\n' | xargs -P 3 -I{} sh -c \
		'PIP_CONFIG_FILE=/dev/null $(BIN)/python -m pip install --dry-run --quiet --isolated --ignore-installed \
			--disable-pip-version-check --index-url https://pypi.org/simple "torch=={}" \
			".[viz,models,hf,widget,test,gpu,docs,lint]" >build/resolve-{}.log 2>&1 \
		&& echo "  torch {}: resolves" || { echo "  torch {}: does not resolve"; grep -A8 ERROR build/resolve-{}.log; exit 255; }'

# ruff (rules in pyproject.toml) and mypy over src/attnkit
lint: $(VENV)/.test-installed
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# the documentation site into site/ (offline; warnings are errors)
docs: $(VENV)/.test-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # not --quiet: mkdocs counts only the warnings it logs

# the wheel (built the standard way, pip wheel ., with the native engine compiled once per x86-64 level: setup.py),
# tagged manylinux by auditwheel (scripts/build_wheel.py, with progress), installed non-editable into a fresh venv outside the repository:
# on a PATH without compilers, the first call loads the wheel's engine and explain names it, and the native
# tests pass on its AVX2 and AVX-512 builds (ATTNKIT_NATIVE_ISA; scripts/check_wheel.py, two workers);
# the quick start with no extras, then `attnkit show`. make wheel-only builds the wheel and stops there.
WHEEL_DIR := $(abspath build/wheel-check)
WHEEL_PIP := $(WHEEL_DIR)/venv/bin/python -m pip install --disable-pip-version-check -c constraints.txt
wheel-only: $(VENV)/.test-installed
	rm -rf $(WHEEL_DIR) build/lib* build/bdist* && mkdir -p $(WHEEL_DIR)
	$(BIN)/python scripts/build_wheel.py $(WHEEL_DIR)

wheel: wheel-only
	@echo "make wheel: installing the wheel into $(WHEEL_DIR)/venv and checking it (its first call, then the native tests on each build)"
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install --disable-pip-version-check "pip>=23.1"
	$(WHEEL_DIR)/venv/bin/python scripts/install_torch.py $(TORCH) -c constraints.txt
	$(WHEEL_PIP) "$$(ls $(WHEEL_DIR)/dist/*.whl)[test]"
	cd $(WHEEL_DIR) && venv/bin/python $(CURDIR)/scripts/check_wheel.py --tests
	cd $(WHEEL_DIR) && venv/bin/python $(CURDIR)/scripts/quick_start.py
	$(WHEEL_PIP) "$$(ls $(WHEEL_DIR)/dist/*.whl)[viz,models]"
	cd $(WHEEL_DIR) && venv/bin/attnkit show "The cat sat." --out shown && test -s shown/attention.html

# the wheel as built the standard way (pip wheel ., isolated: build_backend/attnkit_build.py puts the tested torch
# into the build environment; make wheel-only builds it so) carries the engine: its manifest and its three builds
wheel-standard: $(VENV)/.test-installed
	@test -n "$$(ls $(WHEEL_DIR)/raw/attnkit-*.whl 2>/dev/null)" || $(MAKE) wheel-only
	$(BIN)/python scripts/check_wheel.py --contents "$$(ls $(WHEEL_DIR)/raw/attnkit-*.whl)"

# make fuzz FUZZ_MINUTES=10: the fuzz suite (tests/fuzz) with fresh seeds until the time is up
FUZZ_MINUTES ?= 10
fuzz: $(VENV)/.test-installed
	$(BIN)/python tests/fuzz/run.py --minutes $(FUZZ_MINUTES)

bench: $(VENV)/.demo-installed
	$(BIN)/python benchmarks/cpu.py

clean:
	rm -rf $(VENV) $(VENV_NEXT) attention attention.png .pytest_cache .hypothesis site build
