# distcache developer commands. `make demo` and `make test` are the two a newcomer needs.
# `make install` is idempotent: it creates .venv at the project root and installs the pinned
# CPU stack (torch 2.13.0 CPU wheel, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0 without its CUDA
# fbgemm-gpu requirement, torchx 0.7.0), then distcache in editable mode, and the test tools
# (Triton for its interpreter).

PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(VPY) -m pip install --quiet --disable-pip-version-check

.PHONY: install test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0 "numpy>=1.26"
	$(PIP) fbgemm-gpu-cpu==1.8.0
	$(PIP) --no-deps torchrec==1.8.0
	$(PIP) tensordict torchmetrics==1.0.3 pyre-extensions tqdm iopath torchx==0.7.0
	$(PIP) --no-deps -e .
	$(PIP) "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "ruff>=0.6"
	# Triton (CUDA's torch ships it): its interpreter runs direct staging's kernel in the tests.
	$(PIP) triton==3.5.1
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(VPY) -m pytest -q

demo: install
	PYTHON=$(VPY) launch/torchrun.sh

bench: install
	benchmarks/run_all.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
