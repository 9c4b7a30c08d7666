# Two entry points: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv when missing. torch is installed first and pinned: an unpinned torch would pull a
# multi-gigabyte CUDA build; CPU machines run the kernels under the Triton interpreter.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test lint format clean

$(BIN)/.ready: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(BIN)/.ready
	$(BIN)/ulakv demo

# The pinned SGLang wheel's source, read by the adapter's conformance tests: fetched once, before the
# suite, so that parallel test workers do not all download it (needs PyPI the first time).
SGLANG_READY := $(or $(ULAKV_SGLANG_CACHE),.cache/sglang-0.5.23)/.ready

$(SGLANG_READY): | $(BIN)/.ready
	$(BIN)/python -m tools.sglang_wheel

test: $(BIN)/.ready $(SGLANG_READY)
	$(BIN)/python -m pytest -q -n auto --dist worksteal

lint: $(BIN)/.ready
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.ready
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks
