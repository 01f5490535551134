# npu-hub-kernels. `make demo` and `make test` set up everything they need on a fresh machine.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ORG ?=

.PHONY: setup build demo bench publish test lint ledger clean test-transformers prove-transformers test-forms \
	test-long-context

setup: $(STAMP)

# torch goes first and exact (the local CPU wheel): an unpinned torch would pull GBs of CUDA packages.
# llamafactory goes last and without its dependencies: tests run its NPU kernels next to ours (coexistence)
# and its v1 ModelEngine with our plugin (omegaconf, a dev extra, is the one dependency that needs).
$(STAMP): pyproject.toml setup.py requirements-dev.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or pass PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$$(grep '^torch==' requirements-dev.txt)"
	$(PY) -m pip install --quiet -c requirements-dev.txt -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "$$(grep '^llamafactory==' requirements-dev.txt)"
	touch $(STAMP)

build: setup
	$(PY) scripts/build_cards.py

demo: build
	$(PY) scripts/demo.py $(if $(ORG),--org $(ORG))

# Fusion accounting (counted) and timings: writes .cache/bench/, every table to docs/benchmarks.md, the charts to
# docs/images/, README's short bench section and each card's benchmark.md (which the next build adds to its Hub README).
bench: build
	$(PY) scripts/bench --readme README.md --tables docs/benchmarks.md --images docs/images --cards-dir kernel-cards \
		$(if $(ORG),--org $(ORG))

# make publish ORG=<Hub organisation> [CARDS=npu-rope,...] [DRY_RUN=1]
publish: build
	@test -n "$(ORG)" || { echo "error: make publish needs ORG=<Hub organisation>"; exit 1; }
	$(PY) scripts/publish_cards.py --org '$(ORG)' $(if $(CARDS),--cards $(CARDS)) $(if $(DRY_RUN),--dry-run)

# The constraint ledger's tables in docs/torch-npu-ops.md, rendered from the emulated ops' rules.
ledger: setup
	$(PY) scripts/write_ledger_docs.py

# The older transformers releases the package admits (pyproject.toml: transformers>=5.18,<5.23), each proven in an
# environment of its own: the pinned stack with that transformers, and pytest (the model-table tests need no more).
TRANSFORMERS_RELEASES := 5.18.0 5.20.2

.venv-transformers-%/.installed: pyproject.toml setup.py requirements-dev.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or pass PYTHON=/path/to/python3.11"; exit 1; }
	test -x .venv-transformers-$*/bin/python || $(PYTHON) -m venv .venv-transformers-$*
	.venv-transformers-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-transformers-$*/bin/python -m pip install --quiet "$$(grep '^torch==' requirements-dev.txt)"
	grep -v '^transformers==' requirements-dev.txt > .venv-transformers-$*/constraints.txt
	.venv-transformers-$*/bin/python -m pip install --quiet -c .venv-transformers-$*/constraints.txt -e . transformers==$* pytest pytest-xdist
	touch $@

# The model tables on every older admitted release, as users get them: proven classes swapped, the others eager.
test-transformers: $(foreach release,$(TRANSFORMERS_RELEASES),.venv-transformers-$(release)/.installed)
	@set -e; for release in $(TRANSFORMERS_RELEASES); do \
		.venv-transformers-$$release/bin/python scripts/model_tables.py test; done

# Prove the tables on every admitted release and record what passed (mapping/npu_hub_kernels/models/proven/).
prove-transformers: setup $(foreach release,$(TRANSFORMERS_RELEASES),.venv-transformers-$(release)/.installed)
	$(PY) scripts/model_tables.py prove
	@set -e; for release in $(TRANSFORMERS_RELEASES); do \
		.venv-transformers-$$release/bin/python scripts/model_tables.py prove; done

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: setup lint
	$(PY) -m pytest -n 2

# The attention card's differential harness on every combination of its axes (`make test` runs a sample that covers
# every value of every axis): tests/test_attention_forms.py.
test-forms: setup
	NPU_HUB_KERNELS_ALL_FORMS=1 $(PY) -m pytest -n 2 tests/test_attention_forms.py

# DeepSpeed Ulysses sequence parallelism with the cards, every case at SP 2 and 4, and the Trainer's own order end to
# end (`make test` runs a sample): tests/test_ulysses_sp.py, tests/test_ulysses_sp_smoke.py.
test-long-context: setup
	NPU_HUB_KERNELS_ALL_SP=1 $(PY) -m pytest tests/test_ulysses_sp.py tests/test_ulysses_sp_smoke.py

clean:
	rm -rf build .cache .venv-transformers-*
