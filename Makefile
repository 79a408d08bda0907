# Every target creates the virtual environment it needs; nothing is installed by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo demo-elastic check test test-matrix lint typecheck bench bench-dcp-env clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned here (not in pyproject): 2.13.0 is the CPU build on this machine's disk;
	# an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# s3: the S3 storage (boto3); the tests run it against moto's server (test extra)
	# the integrations' frameworks too (extras of the package, not of its core install):
	# mypy checks stalwart.integrations against them and their tests run
	$(PY) -m pip install -q -e '.[test,s3,hf,lightning,bench]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) examples/demo.py

demo-elastic: setup
	$(PY) examples/demo.py --elastic

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

typecheck: setup
	$(VENV)/bin/mypy

# while changing code: lint, type check and the unit tier (every test that runs in one
# process; tests marked e2e start one: tests/_tiers.py), on TEST_WORKERS workers
check: lint typecheck
	$(VENV)/bin/pytest -m "not e2e" -n $(TEST_WORKERS) --dist loadgroup

# before landing (CI's command): the unit tier and the job tier, without the matrices'
# cells that `make test-matrix` runs (tests marked `matrix`), with the line coverage of
# src/, on TEST_WORKERS pytest-xdist workers (tests/_workers.py keeps a test file, or a
# corpus script's cells, on one worker; 0: one process). A job test keeps about one core
# busy and waits part of its time (a lease, a detection bound, a hung rank's deadline), so
# two workers use a 2-core machine better than one: job-test samples took 0.81x-0.87x of
# one process's wall time on 2 cores. More workers than cores only raises the load every
# wait scales with. --durations=40: the 40 slowest tests; the log ends with the time of
# each tier and of the slowest e2e test files (tests/_timing.py): where the time goes.
TEST_WORKERS ?= 2
test: lint typecheck
	$(VENV)/bin/pytest -m "not matrix" -n $(TEST_WORKERS) --dist loadgroup \
		--cov=stalwart --cov-report=term:skip-covered --durations=40

# the matrices' cells (tests marked `matrix`; CI runs them after `make test`): the corpus
# matrix's framework scripts and extra strategies (tests/corpus: third-party-style scripts
# under every strategy with faults), `stalwart compare`'s torchft route (tests/cli) and the
# multi-host matrix (tests/hosts: jobs across network namespaces with network faults and
# partitions; root, iproute2 and nftables; tests/hosts/conftest.py).
# The hosts' tests wait most of their time (a partition, a lease, TCP's backoff after a
# heal) and each lab is its own bridge, namespaces and nftables table, so MATRIX_WORKERS
# run at once (tests/_workers.py).
MATRIX_WORKERS ?= 2
test-matrix: setup
	$(VENV)/bin/pytest -m matrix -n $(MATRIX_WORKERS) --dist loadgroup

# every benchmark on the harness (bench/_harness.py: medians and spread over repetitions),
# results in bench/results/latest.json, the table in docs/benchmarks.md (issue 34).
# QUICK=1: one repetition at small sizes, a look that it all runs (not the documented figures)
bench: setup bench-dcp-env
	$(PY) bench/report.py $(if $(QUICK),--quick,)

# the peer of bench/s3.py, DCP's fsspec writer, needs s3fs, whose aiobotocore pins an older
# botocore than the project's boto3: it runs from this side environment (torch + s3fs only)
DCP_ENV := bench/.venv-dcp
bench-dcp-env: $(DCP_ENV)/.installed-stamp
$(DCP_ENV)/.installed-stamp:
	$(PYTHON) -m venv $(DCP_ENV)
	$(DCP_ENV)/bin/python -m pip install -q torch==2.13.0 s3fs
	touch $@

clean:
	rm -rf $(VENV) $(DCP_ENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
