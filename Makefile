# gpufrac developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-realnode test bench lint testenv venv clean

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

# The same demo on one REAL node (containerd, runc, kubelet; root and cgroups): the pods run, and what
# each container got is read from inside its process.
demo-realnode: venv testenv
	$(VENV)/bin/gpufrac demo --runtime containerd

test: venv testenv
	$(PY) -m pytest -q -p no:cacheprovider

# Every benchmark prints a one-line JSON summary last; results and commands are in docs/benchmarks.md.
# BENCHES=... runs a subset, e.g. `make bench BENCHES="placement_speed usage_collect"`.
BENCHES ?= placement_speed placement_memory usage_collect nri_create_latency scheduler_e2e trace_quality
bench: venv testenv
	@mkdir -p out/bench
	@for b in $(BENCHES); do \
	  echo "== bench/$$b.py"; \
	  $(PY) bench/$$b.py > out/bench/$$b.log 2>&1 || { tail -n 20 out/bench/$$b.log; exit 1; }; \
	  tail -n 1 out/bench/$$b.log | tee out/bench/$$b.json; \
	done; echo "summaries in out/bench/*.json"

lint: venv
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

clean:
	rm -rf $(VENV) testenv/bin
