# Two set-up commands: `make demo` (main job on the shipped demo model) and `make test`.
# Both create .venv and install what is missing. torch is installed first, pinned to the CPU build that
# lies on this project's machines; on a GPU machine install your own torch first and `pip install -e .`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: venv demo test lint bench clean

$(BIN)/trimvlm: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(BIN)/trimvlm

venv: $(BIN)/trimvlm

demo: venv
	$(BIN)/trimvlm demo

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
