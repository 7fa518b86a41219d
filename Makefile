# gpufrac developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-realnode test test-latest bench lint lock testenv venv clean

# The venv installs the exact versions of requirements.lock (what the suite last passed with; `make lock`
# renews it from pyproject's ranges), then the package itself without resolving anything again.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# Re-resolve pyproject's ranges (runtime + test extras) to the newest versions into requirements.lock.
lock: venv
	$(PY) -m pip install --quiet 'pip-tools>=7.4,<8'
	$(VENV)/bin/pip-compile --quiet --upgrade --allow-unsafe --extra test --strip-extras --no-emit-index-url \
	  --no-emit-find-links --output-file requirements.lock pyproject.toml

# The suite against the newest versions pyproject's ranges allow (not the lock), in its own venv: what a
# user's `pip install gpufrac` may get tomorrow. PYTEST_ARGS narrows it, e.g. PYTEST_ARGS=tests/contract.
LATEST_VENV ?= .venv-latest
PYTEST_ARGS ?=
test-latest: testenv
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The Go programs (real kube-apiserver + etcd, NRI runtime driver) and the protobuf messages generated
# from the pinned Go modules (NRI, CRI, the kubelet's DRA plugin API); every step is a no-op when already up to date.
testenv: venv
	bash testenv/build.sh
	bash testenv/promtool.sh
	$(PY) scripts/gen-nri-protos
	$(PY) scripts/gen-cri-protos
	$(PY) scripts/gen-kubelet-protos

demo: venv testenv
	$(VENV)/bin/gpufrac demo

# The same demo on one REAL node (containerd, runc, kubelet; root and cgroups): the pods run, and what
# each container got is read from inside its process.
demo-realnode: venv testenv
	$(VENV)/bin/gpufrac demo --runtime containerd

# Two worker processes (pytest-xdist): most tests wait on a server, a watch or a child process, so two
# share two cores well. tests/conftest.py keeps the tests of the machine's runtime stack (real node,
# install) in one worker. TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2
test: venv testenv
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup

# Every benchmark prints a one-line JSON summary last; results and commands are in docs/benchmarks.md.
# BENCHES=... runs a subset, e.g. `make bench BENCHES="placement_speed usage_collect"`.
BENCHES ?= placement_speed placement_memory preemption_speed preemption_e2e usage_collect nri_create_latency scheduler_e2e trace_quality
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
	rm -rf $(VENV) $(LATEST_VENV) testenv/bin
