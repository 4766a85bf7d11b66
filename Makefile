# Two set-up commands: `make demo` (main job on the shipped demo model) and `make test`.
# Both create .venv and install what is missing. torch is installed first, pinned to the CPU build that
# lies on this project's machines; on a GPU machine install your own torch first and `pip install -e .`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: venv demo test lint bench clean lmms ray serve results docs

$(BIN)/trimvlm: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(BIN)/trimvlm

venv: $(BIN)/trimvlm

demo: venv
	$(BIN)/trimvlm demo

# `make test PYTEST_ARGS=...` passes options to this run alone (CI: --reverse-files), never to a pytest a test starts
test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Optional extras, installed into the same venv with the installed torch pinned ($(PIN), written from
# `torch.__version__`), so the CPU torch stays (each target checks that torch's version did not change).
# `make ray`: trimvlm[ray] (Ray and Ray Serve, for `trimvlm eval --ray` and `trimvlm serve --replicas N --ray`). `make lmms`: lmms-eval for the bridge
# (`python -m lmms_eval --model trimvlm ...`) without torchvision, which cannot import beside the CPU torch
# (constraints/lmms-cpu.txt says why and lists lmms-eval's other requirements).
LMMS_EVAL ?= lmms-eval==0.7.3
PIN := $(VENV)/torch-pin.txt
TORCH_VERSION = $(BIN)/python -c "import torch; print(torch.__version__)"

$(PIN): venv
	echo "torch==$$($(TORCH_VERSION))" > $(PIN)

ray: $(PIN)
	$(BIN)/pip install -q -c $(PIN) -e ".[dev,ray]"
	@echo "torch $$($(TORCH_VERSION))"; grep -qx "torch==$$($(TORCH_VERSION))" $(PIN)

# `make serve`: trimvlm[serve] (FastAPI, uvicorn, httpx) for `trimvlm serve` and its HTTP tests
serve: $(PIN)
	$(BIN)/pip install -q -c $(PIN) -e ".[dev,serve]"
	@echo "torch $$($(TORCH_VERSION))"; grep -qx "torch==$$($(TORCH_VERSION))" $(PIN)

lmms: $(PIN)
	$(BIN)/pip install -q -c $(PIN) --no-deps "$(LMMS_EVAL)"
	$(BIN)/pip install -q -c $(PIN) -r constraints/lmms-cpu.txt
	@echo "torch $$($(TORCH_VERSION))"; grep -qx "torch==$$($(TORCH_VERSION))" $(PIN)

# `make results`: write every figure table of README.md and docs/ from docs/results/*.json (between
# `<!-- results:NAME -->` markers); tests/test_results_tables.py checks that the committed tables are what it writes
results: venv
	$(BIN)/python benchmarks/write_results.py

# `make docs`: the documentation site (MkDocs, Material theme, API reference from the docstrings) in site/,
# built strictly: a broken link, a missing page or an unresolved docstring reference fails it
docs: $(PIN)
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || \
		$(BIN)/pip install -q -c $(PIN) -e ".[dev,docs]"
	$(BIN)/mkdocs build --strict

lint: venv
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
