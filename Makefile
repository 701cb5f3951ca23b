# lpcal: make demo | make test | make bench | make soak
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench soak lint clean

# Printed at the end of `make demo` and `make test`: the lpcal command is installed in the venv,
# not on PATH.
CLI_HINT = printf '\nThe lpcal command is in $(VENV): run ". $(BIN)/activate" to put it on PATH,\nor call $(BIN)/lpcal directly (e.g. $(BIN)/lpcal --help).\n'

$(STAMP): pyproject.toml $(wildcard daemon/csrc/*)
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m daemon.tools.demo
	@$(CLI_HINT)

# The tests but those marked `serial` run on 2 pytest-xdist workers: most broker tests wait
# (group joins, session timeouts), so two overlap well on 2 cores; `--dist loadscope` keeps a
# module on one worker (its module fixtures run once). Then the `serial` tests (they measure
# timing: poll gaps, rates, prompt exits) run in a plain pytest run of their own, as before.
# TEST_WORKERS=0: no xdist workers.
TEST_WORKERS ?= 2

test: $(STAMP)
	bash deploy/tools/ensure-promtool.sh
	status=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not serial" || status=$$?; \
	$(BIN)/python -m pytest -q -m serial || status=$$?; \
	$(CLI_HINT); exit $$status

bench: $(STAMP)
	$(BIN)/python -m tests.bench.run_all

soak: $(STAMP)
	LPCAL_SOAK=1 $(BIN)/python -m pytest -q tests/reliability -m "soak"

lint: $(STAMP)
	$(BIN)/ruff check lpcal daemon tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
