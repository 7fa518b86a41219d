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

# The Go programs (real kube-apiserver + etcd, NRI runtime driver) and the protobuf messages generated
# from the pinned Go modules (NRI, CRI); every step is a no-op when already up to date.
testenv: venv
	bash testenv/build.sh
	$(PY) scripts/gen-nri-protos
	$(PY) scripts/gen-cri-protos

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
