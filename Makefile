# lpcal: make demo | make test | make bench | make soak
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench soak lint clean

$(STAMP): pyproject.toml $(wildcard daemon/csrc/*)
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m daemon.tools.demo

test: $(STAMP)
	bash deploy/tools/ensure-promtool.sh
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m tests.bench.run_all

soak: $(STAMP)
	LPCAL_SOAK=1 $(BIN)/python -m pytest -q tests/reliability -m "soak"

lint: $(STAMP)
	$(BIN)/ruff check lpcal daemon tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
