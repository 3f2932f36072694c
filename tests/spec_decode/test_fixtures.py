"""The committed trained fixtures (fixtures/models, fixtures/prompts.jsonl): the data the tests and the bench run on.

Integrity: manifest sha256/sizes, loaders (transformers and ours), tokenizer.
Quality floors: greedy float32 is deterministic, so each floor sits a little under the value that
``fixtures/make_fixtures.py`` measured and recorded in MANIFEST.json; a regression in the model,
the heads' loaders or the pipeline drops below it.

The script that builds them is tested in test_make_fixtures.py, the pytest plugin that finds them in
integrations/test_pytest_plugin.py.
"""

from __future__ import annotations

import hashlib
import json
import statistics

import pytest
import torch

from spec_decode import SpecDecoder
from spec_decode.fixtures import DRAFT_SUBDIR, EAGLE3_SUBDIR, EAGLE_SUBDIR, TARGET_SUBDIR, find_fixtures_dir
from spec_decode.models.eagle import Eagle3Head, EagleHead, load_drafter
from spec_decode.models import Transformer

MAX_FIXTURE_BYTES = 45_000_000   # the tiny models, and the real model's EAGLE-3 head (under 25 MB alone)
FLOOR_MARGIN = 0.02  # agreement / accepted length may drop this much below the recorded value
NLL_MARGIN = 0.02


# ------------------------------------------------------------------ integrity


def test_manifest_hashes_match_every_file(fixtures_dir, manifest):
    listed = manifest["files"]
    on_disk = {p.relative_to(fixtures_dir).as_posix() for p in (fixtures_dir / "models").rglob("*")
               if p.is_file() and p.name != "MANIFEST.json"} | {"prompts.jsonl"}
    assert set(listed) == on_disk
    for rel, meta in listed.items():
        data = (fixtures_dir / rel).read_bytes()
        assert len(data) == meta["bytes"], rel
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], rel
    assert sum(m["bytes"] for m in listed.values()) < MAX_FIXTURE_BYTES


def test_weights_are_stored_in_bfloat16(safespec_tiny_target_path, safespec_tiny_draft_path, safespec_tiny_eagle_path,
                                        safespec_tiny_eagle3_path):
    from safetensors import safe_open

    for path in (safespec_tiny_target_path, safespec_tiny_draft_path, safespec_tiny_eagle_path,
                 safespec_tiny_eagle3_path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes <= {"BF16", "I64", "BOOL"}, (path, dtypes)
        assert "BF16" in dtypes


def test_tokenizer_loads_with_autotokenizer(safespec_tiny_target_path, safespec_tiny_draft_path, safespec_tiny_prompts):
    from transformers import AutoTokenizer

    for path in (safespec_tiny_target_path, safespec_tiny_draft_path):
        tok = AutoTokenizer.from_pretrained(path)
        assert len(tok) == 4096
        assert tok.eos_token == "<|endoftext|>"
        text = safespec_tiny_prompts[0]["text"]
        assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round-trips exactly


def test_target_loads_in_transformers_and_ours_with_equal_logits(safespec_tiny_target_path, shipped_target,
                                                                 safespec_tiny_prompts):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(safespec_tiny_target_path, dtype=torch.float32).eval()
    ids = torch.tensor([safespec_tiny_prompts[0]["token_ids"]])
    with torch.no_grad():
        want = hf(ids).logits
        got = shipped_target(ids, shipped_target.new_cache(1, ids.shape[1])).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    cfg = shipped_target.config
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (12, 4096, False)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA


def test_draft_lm_loads_in_transformers_and_ours(safespec_tiny_draft_path, shipped_target):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(safespec_tiny_draft_path, dtype=torch.float32)
    assert hf.config.num_hidden_layers <= 2
    draft = load_drafter(safespec_tiny_draft_path, shipped_target)
    assert isinstance(draft, Transformer) and draft.config.vocab_size == shipped_target.config.vocab_size


def test_heads_load_in_their_layouts(safespec_tiny_eagle_path, safespec_tiny_eagle3_path, shipped_target, manifest):
    eagle = load_drafter(safespec_tiny_eagle_path, shipped_target)
    eagle3 = load_drafter(safespec_tiny_eagle3_path, shipped_target)
    assert isinstance(eagle, EagleHead) and isinstance(eagle3, Eagle3Head)
    Vd = eagle3.draft_vocab_size
    assert Vd < shipped_target.config.vocab_size  # a reduced draft vocabulary
    target_ids = eagle3.to_target_ids(torch.arange(Vd))
    assert torch.equal(target_ids, target_ids.sort().values) and target_ids.unique().numel() == Vd
    assert int(eagle3.t2d.sum()) == Vd and eagle3.t2d[target_ids].all()
    assert list(eagle3.aux_layers) == manifest["stages"]["eagle3"]["aux_layers"]


# ------------------------------------------------------------------ quality floors (float32, deterministic)


@pytest.mark.slow
def test_target_nll_and_head_agreement_floors(safespec_tiny_prompts, shipped_target, safespec_tiny_eagle_path,
                                              safespec_tiny_eagle3_path, manifest):
    """Teacher-forced on the held-out prompts, each alone (the same computation as the build's metrics)."""
    rec = manifest["metrics"]["prompts"]
    eagle = EagleHead.from_pretrained(safespec_tiny_eagle_path, shipped_target, dtype=torch.float32)
    eagle3 = Eagle3Head.from_pretrained(safespec_tiny_eagle3_path, shipped_target, dtype=torch.float32)
    nll, n, agree, rows = 0.0, 0, {"eagle": 0, "eagle3": 0}, 0
    with torch.no_grad():
        for p in safespec_tiny_prompts:
            ids = torch.tensor([p["token_ids"]])
            T = ids.shape[1]
            out = shipped_target(ids, shipped_target.new_cache(1, T), aux_layers=eagle3.aux_layers)
            nll += torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:], reduction="sum").item()
            n += T - 1
            want = out.logits[:, 1:].argmax(-1)
            for name, head, feat in (("eagle", eagle, out.hidden), ("eagle3", eagle3, eagle3.fuse(out.aux_hidden))):
                d = head(ids[:, 1:], feat[:, :-1], head.new_cache(1, T - 1))
                agree[name] += (head.to_target_ids(d.logits.argmax(-1)) == want).sum().item()
            rows += want.numel()
    assert nll / n <= rec["target_nll"] + NLL_MARGIN
    assert agree["eagle"] / rows >= rec["eagle_top1_agreement"] - FLOOR_MARGIN
    assert agree["eagle3"] / rows >= rec["eagle3_top1_agreement"] - FLOOR_MARGIN


@pytest.mark.parametrize("name, method, head, num_steps, topk, num_draft_tokens", [
    ("eagle_chain_k4", "eagle", "safespec_tiny_eagle_path", 4, 1, 5),
    ("eagle2_tree_5_4_8", "eagle", "safespec_tiny_eagle_path", 5, 4, 8),
    ("eagle3_tree_5_4_8", "eagle3", "safespec_tiny_eagle3_path", 5, 4, 8),
])
@pytest.mark.slow
def test_greedy_acceptance_floor(request, safespec_tiny_target_path, safespec_tiny_prompts, manifest, name, method,
                                 head, num_steps, topk, num_draft_tokens):
    from spec_decode import SpecDecoder

    sub = manifest["acceptance"]["test_subset"]
    dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, request.getfixturevalue(head), method=method,
                                      dtype=torch.float32, num_steps=num_steps, topk=topk,
                                      num_draft_tokens=num_draft_tokens, nan_policy="raise")
    # measured as recorded (measure_fixtures): every step at the full shape, none trimmed at a request's end
    dec.trim_last_steps = False
    prompts = [p["token_ids"] for p in safespec_tiny_prompts[: sub["num_prompts"]]]
    results = dec.generate(prompts, max_new_tokens=sub["max_new_tokens"], ignore_eos=True)   # as recorded: fixed length
    mean = statistics.fmean(n for r in results for n in r.accepted_lengths)
    assert mean >= sub[name] - FLOOR_MARGIN
    assert mean > 1.0  # speculation accepts drafts at all


# ------------------------------------------------------------------ every method loads and decodes
FX = find_fixtures_dir()
needs_fixtures = pytest.mark.skipif(FX is None or not (FX / TARGET_SUBDIR).is_dir(), reason="no shipped fixtures")
PROMPT = [5, 9, 14, 3, 22, 7]


@needs_fixtures
@pytest.mark.parametrize("method, subdir", [("eagle", EAGLE_SUBDIR), ("eagle3", EAGLE3_SUBDIR),
                                            ("draft_model", DRAFT_SUBDIR)])
def test_the_shipped_fixtures_still_load(method, subdir):
    dec = SpecDecoder.from_pretrained(FX / TARGET_SUBDIR, FX / subdir, method=method, dtype="fp32", device="cpu")
    assert dec.generate([PROMPT], max_new_tokens=3, ignore_eos=True)[0].token_ids
