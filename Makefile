# Two commands set everything up on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-all bench clean

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh $(VENV)

demo: $(VENV)/.installed
	$(VENV)/bin/pagemem demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results
