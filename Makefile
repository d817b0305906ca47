# Two commands set everything up on a fresh machine:  `make train`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: train demo test test-all bench clean

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh $(VENV)

# the main job: pagemem train with its embedded default (ARGS: more flags, e.g. ARGS="--resume auto")
train: $(VENV)/.installed
	$(VENV)/bin/pagemem train $(ARGS)

demo: $(VENV)/.installed
	$(VENV)/bin/pagemem demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/pagemem bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results/quick runs
