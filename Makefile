# The two commands a newcomer needs: `make demo` and `make test`. Both install into .venv when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo demo-tools test test-all test-fast bench drill lint docs clean

install:
	@VENV=$(VENV) scripts/install.sh

demo: install
	@$(PY) -m flows.demo

# The tool-use demo: multi-turn GRPO with a calculator tool (README, "Tool use").
demo-tools: install
	@$(PY) -m flows.demo --config configs/demo_tools_cpu.yaml

test: install
	@$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: install
	@$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	@$(PY) -m pytest -q -m "not slow and not integration" $(PYTEST_ARGS)

bench: install
	@$(PY) -m bench.run_all

# The simulated fault-drill ladder 3 -> 6 -> 12 nodes (configs/drills/ladder.yaml): report and plots in
# bench/results/drill/, the fitted recovery exponent in bench/results/drill_ladder.json.
drill: install
	@$(PY) -m bench.drill_ladder

# The config reference from the schema, then the site; --strict: a broken link or anchor fails the build.
docs: install
	@$(PY) docs/config_reference.py
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: install
	@$(PY) -m ruff check forge_core tasks flows tests bench

clean:
	rm -rf .forge-store .forge-runs .pytest_cache site
