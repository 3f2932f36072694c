"""The EAGLE-1/2 head over a frequency-ranked draft vocabulary (FR-Spec): ``draft_vocab_size`` < V.

The head gets its own lm_head over the Vd draft ids (started as the target's rows of those ids) and
EAGLE-3's ``d2t``/``t2d`` maps. Verification is against the full vocabulary, so greedy output is the
target's and, at temperature 1, the emitted law is the target's (chi-square against the exact law,
with a mutant that scatters q to the wrong target ids and must be caught).
"""
from __future__ import annotations

import json

import pytest
import torch

from spec_decode import SpecDecoder
from spec_decode.models import EagleHead, Transformer, load_drafter
from test_pipeline_distribution import TREE, exact_joint, rejects, sample_counts
from tiny_models import _head_config, _randomize_, make_tiny_target

DRAFT_IDS = torch.tensor([0, 1, 3, 4])   # V = 6: target ids 2 and 5 are never drafted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("fr"), seed=3, vocab_size=6, num_hidden_layers=2)
    return Transformer.from_pretrained(path, dtype=torch.float32)


def make_fr_eagle(target: Transformer, draft_ids: torch.Tensor = DRAFT_IDS, *, seed: int = 4,
                  randomize: bool = True) -> EagleHead:
    """A random EAGLE-1/2 head over ``draft_ids`` (its lm_head re-drawn too unless ``randomize=False``)."""
    torch.manual_seed(seed)
    config = _head_config(target, extra={"draft_vocab_size": len(draft_ids)})
    head = EagleHead(config, target, draft_token_ids=draft_ids)
    if randomize:
        _randomize_(head, seed)
    return head.eval()


def test_lm_head_starts_as_the_targets_rows(target):
    head = make_fr_eagle(target, randomize=False)
    h = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert head.draft_vocab_size == 4
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[DRAFT_IDS])
    torch.testing.assert_close(head.compute_logits(h), target.compute_logits(h)[..., DRAFT_IDS])
    assert head.to_target_ids(torch.tensor([[0, 1, 2, 3]])).tolist() == [[0, 1, 3, 4]]
    assert head.t2d.tolist() == [True, True, False, True, True, False]
    probs = torch.softmax(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), -1)
    full = head.to_target_probs(probs)
    assert torch.equal(full[:, DRAFT_IDS], probs) and (full[:, [2, 5]] == 0).all()


def test_full_vocabulary_head_has_no_maps(target):
    head = EagleHead(_head_config(target), target)
    ids = torch.tensor([[5, 2]])
    assert head.d2t is None and head.t2d is None and head.lm_head is target.lm_head
    assert head.to_target_ids(ids) is ids and head.draft_vocab_size == 6
    assert "d2t" not in head.state_dict() and "lm_head.weight" not in head.state_dict()
    with pytest.raises(ValueError, match="whole vocabulary"):
        head.set_draft_vocab(torch.arange(6))
    with pytest.raises(ValueError, match="draft_vocab_size < vocab_size"):
        EagleHead(_head_config(target), target, draft_token_ids=torch.arange(3))


def test_roundtrip_keys_and_outputs(target, tmp_path):
    head = make_fr_eagle(target)
    head.save_pretrained(tmp_path / "fr")
    cfg = json.loads((tmp_path / "fr" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 4 and cfg["tie_word_embeddings"] is False
    loaded = load_drafter(tmp_path / "fr", target, method="eagle")
    assert isinstance(loaded, EagleHead) and loaded.draft_vocab_size == 4
    assert {"lm_head.weight", "d2t", "t2d"} <= set(loaded.state_dict())
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    ids, feat = torch.tensor([[1, 3, 4]]), torch.randn(1, 3, target.config.hidden_size)
    with torch.no_grad():
        want = head(ids, feat, head.new_cache(1, 4)).logits
        got = loaded(ids, feat, loaded.new_cache(1, 4)).logits
    assert got.shape == (1, 3, 4) and torch.equal(got, want)


def test_a_tied_targets_config_still_loads_the_heads_lm_head(target, tmp_path):
    """A head config copied from a target that ties its embedding (as SmolLM2 does) keeps its own lm_head."""
    config = _head_config(target, extra={"draft_vocab_size": 4}, tie_word_embeddings=True)
    head = EagleHead(config, target, draft_token_ids=DRAFT_IDS)
    head.save_pretrained(tmp_path / "tied")
    loaded = load_drafter(tmp_path / "tied", target)
    assert torch.equal(loaded.lm_head.weight, head.lm_head.weight)


def test_d2t_outside_the_vocabulary_names_the_file(target, tmp_path):
    head = make_fr_eagle(target)
    head.d2t[3] = 40   # draft id 3 -> target id 43, outside [0, 6)
    head.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"bad.*d2t maps draft id 3 to target id 43"):
        load_drafter(tmp_path / "bad", target)


@pytest.mark.parametrize("shape", [dict(num_steps=3, topk=1, num_draft_tokens=4), TREE])
def test_greedy_output_is_the_targets(target, shape):
    head = make_fr_eagle(target)
    prompts = [[1, 2, 3], [4, 0], [5, 5, 1, 2]]
    want = SpecDecoder(target, None, method="none").generate(prompts, max_new_tokens=24)
    got = SpecDecoder(target, head, method="eagle", **shape).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert any(n > 1 for r in got for n in r.accepted_lengths), "no draft accepted: the test is idle"


@pytest.mark.parametrize("draft_sampling", ["auto", "greedy"])
@pytest.mark.slow
def test_temperature_one_matches_the_target_distribution(target, draft_sampling):
    decoder = SpecDecoder(target, make_fr_eagle(target), method="eagle", draft_sampling=draft_sampling, **TREE)
    counts, mean_accepted = sample_counts(decoder, seed=11)
    assert rejects(counts, exact_joint(target)) == (False, False)
    assert mean_accepted > 1.2


@pytest.mark.slow
def test_mutant_scattering_q_to_the_first_ids_is_caught(target, monkeypatch):
    """q written at target ids 0..Vd-1 (d2t ignored) while drafts map through d2t: the law breaks."""
    def first_ids(self, probs):
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        out[..., : probs.shape[-1]] = probs
        return out

    monkeypatch.setattr(EagleHead, "to_target_probs", first_ids)
    decoder = SpecDecoder(target, make_fr_eagle(target), method="eagle", **TREE)
    counts, _ = sample_counts(decoder, seed=11)
    assert any(rejects(counts, exact_joint(target)))

