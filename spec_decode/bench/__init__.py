"""``spec-bench``: every decoding method side by side, the cost of NaN safety, and plots.

Subcommands (``spec-bench [SUBCOMMAND] [OPTIONS]``, or ``python -m spec_decode.bench``):

* *(none)*: the end-to-end benchmark (``spec_decode.bench.harness``, the harness the other subcommands share); writes ``DIR/results.json`` and
  ``DIR/results.png``. With no options it runs on the shipped tiny fixtures and held-out prompts.
* ``numerics``: the sanitize-and-count micro-benchmark (``spec_decode.bench.numerics_bench``);
  writes ``DIR/numerics.json``.
* ``gpu-check``: a few-minute CUDA smoke check (``spec_decode.bench.gpu_check``).
* ``profile``: the split of one speculative step in fractions of one ``ar`` step, through public hooks
  (``spec_decode.bench.profile_step``).
* ``tune``: a sweep over tree shapes on held-out prompts; writes ``DIR/tune.json`` and ``DIR/tune.png``
  and names the best shape per temperature (``spec_decode.bench.tune``).

The JSON layout is a contract for scripts; it is pinned in ``docs/bench.md`` and checked by
``tests/spec_decode/bench/test_bench.py``.
"""

from spec_decode.bench.cli import main

__all__ = ["main"]
