# Two entry points: `make serve` (main job on the embedded tiny model) and `make test`
# (`make test-fast` for the quick tier).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve lint docs test test-fast bench clean

setup: $(STAMP)

# torch is pinned to the CPU build first so that pip does not pull a CUDA wheel on CPU machines.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# the Mooncake KV transfer backend (CPU build) imports only with libibverbs: best effort, the
	@# tests say why they skip it where it cannot be installed
	-command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1 && (apt-get update -qq; apt-get install -y -qq libibverbs1) >/dev/null 2>&1
	-$(PY) -m pip install -q 'mooncake-transfer-engine-non-cuda>=0.3; platform_system == "Linux" and platform_machine == "x86_64"'
	touch $(STAMP)

serve: setup
	$(VENV)/bin/afd serve

# lint first: a formatting or lint error fails the test command (and CI) in seconds
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the documentation site builds strictly: a broken link or a page missing from the nav fails here
# (not --quiet: it hides the warnings that --strict counts, and the build then passes anyway)
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir $(CURDIR)/site

# the whole suite (what CI runs), with the 25 slowest tests at the end
test: lint docs
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=25 tests

# the quick tier: everything not marked slow (no deployments of processes, benchmarks or whole
# engines under the Triton interpreter); GPU tests skip themselves without CUDA
test-fast: lint
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=10 -m "not slow" tests

bench: setup
	$(PY) -m benchmarks.bench_offline

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
