"""The cached index tables (kept because they pay: docs/performance.md) hold the values they stand for,
and nothing the decoder runs writes into them."""

from __future__ import annotations

import pytest
import torch

from samplers import draws
from spec_decode import SpecDecoder, drafting
from spec_decode.models import Transformer, masks

CPU = torch.device("cpu")
# (module, name) of every cached table a decode step reads
TABLES = [(masks, "_arange_table"), (masks, "_bias_values"), (drafting, "_chain_layout"), (drafting, "_pool_depths"),
          (draws, "race_tail")]
CACHED = {name: getattr(module, name) for module, name in TABLES}


def test_tables_equal_the_values_they_stand_for():
    for n in (1, 5, 64, 65, 300):
        assert torch.equal(masks._positions(n, CPU), torch.arange(n))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        zero, ninf = masks._bias_values(dtype, CPU)
        assert zero.dtype == ninf.dtype == dtype and zero.item() == 0 and ninf.item() == float("-inf")
    parents, depth, mask = drafting._chain_layout(3, 5, CPU)
    assert torch.equal(parents, torch.arange(-1, 4).expand(3, 5)) and torch.equal(depth, torch.arange(5).expand(3, 5))
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 5, 5))
    assert torch.equal(drafting._pool_depths((1, 4, 2), (0, 1, 2), CPU), torch.tensor([0, 1, 1, 1, 1, 2, 2]))
    assert torch.equal(draws.race_tail(6, CPU), -1.0 - torch.arange(6, dtype=torch.float64))


def _recording(monkeypatch, seen: list):
    """Wrap every cached table so that each tensor it hands out is remembered with a copy of its value."""
    for module, name in TABLES:
        cached = getattr(module, name)

        def wrapper(*args, _cached=cached):
            out = _cached(*args)
            for t in (out if isinstance(out, tuple) else (out,)):
                seen.append((t, t.clone()))
            return out

        monkeypatch.setattr(module, name, wrapper)


def _written(seen: list) -> int:
    return sum(not torch.equal(t, copy) for t, copy in seen)


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    from tiny_models import make_tiny_eagle, make_tiny_target

    root = tmp_path_factory.mktemp("cached_tables")
    target = Transformer.from_pretrained(make_tiny_target(root, seed=0), dtype=torch.float32)
    return target, make_tiny_eagle(target, root / "eagle")


SHAPES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4), "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_generate_never_writes_into_a_cached_table(monkeypatch, target_and_draft, shape):
    target, eagle = target_and_draft
    seen: list = []
    _recording(monkeypatch, seen)
    dec = SpecDecoder(target, eagle, **SHAPES[shape])
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    for temperature in (0.0, 1.0):
        dec.generate(prompts, max_new_tokens=12, temperature=temperature, seed=1, ignore_eos=True)
    assert len(seen) > 0, "no cached table was read: the recording does not reach the decoder"
    assert _written(seen) == 0


def test_a_write_into_a_cached_table_is_caught(monkeypatch):
    """The check above catches a caller that writes into a table it was handed (a mutant of ``race_scores``)."""
    seen: list = []
    _recording(monkeypatch, seen)
    real = draws.race_scores

    def writing_race_scores(weights, generator):
        draws.race_tail(weights.shape[-1], weights.device).add_(1.0)
        return real(weights, generator)

    monkeypatch.setattr(draws, "race_scores", writing_race_scores)
    try:
        draws.sample_without_replacement(torch.rand(2, 9), 3)
        assert _written(seen) > 0
    finally:
        CACHED["race_tail"].cache_clear()   # the mutant wrote into the real table: drop it
