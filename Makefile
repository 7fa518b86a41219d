# gpufrac developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint testenv venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

testenv:
	bash testenv/build.sh

demo: venv testenv
	$(VENV)/bin/gpufrac demo

test: venv testenv
	$(PY) -m pytest -q -p no:cacheprovider

bench: venv testenv
	$(PY) -m bench.run_all

lint: venv
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

clean:
	rm -rf $(VENV) testenv/bin
