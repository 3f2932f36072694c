# One entry point for humans and CI. Every target creates or reuses .venv.
# CPU machines: torch is pinned to the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
# GPU users: `make test TORCH_SPEC=torch` (or install your CUDA torch first; see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.safespec-installed

.PHONY: venv test test-fp16 demo bench fixtures clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m numerics.demo

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
