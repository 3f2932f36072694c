"""The anchor column: llama.cpp (``llama-cpp-python``) on the GGUF file the target was converted from.

``llama_cpp`` is llama.cpp's plain decoding; ``llama_cpp_lookup`` its prompt lookup decoding
(``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` as ``Llama(draft_model=...)``). Both run the
run's prompts as token ids (no tokenizer, no BOS added: the ids are the chat template's, as for every
method), exactly ``max_new_tokens`` tokens each (EOS ignored: ``Llama.generate`` never stops by itself,
the runner stops it), on ``--threads`` threads, one prompt per call with a full prefill.

Not exact-equivalent to ``ar``: llama.cpp runs the file's quantized weights with its own kernels and its
own sampler (at T>0 another random stream), so ``greedy_equals_ar`` says whether its greedy tokens
happened to agree, not whether a guarantee held. ``llama-cpp-python`` builds C++ on install: it is the
``[anchor]`` extra, not part of ``[test]``; without it the suite leaves the anchor out with one line
(``args.ANCHOR_SKIPPED``).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec_decode.bench.config import MethodSpec
from spec_decode.bench.machine import Stopwatch
from spec_decode.bench.runner import CallResult, prompt_seed

LLAMA_SEED_LIMIT = 2**32 - 1   # llama.cpp seeds are uint32, and 0xFFFFFFFF asks it for a random one


@dataclass
class CountingDraft:
    """A llama.cpp draft model that counts its calls: ``Llama.generate`` calls it once per verify step,
    after the step's tokens were sampled, so the tokens yielded between two calls are one step's."""

    draft: object   # a LlamaPromptLookupDecoding: input ids (n,) -> draft ids (k,)
    calls: int = 0

    def __call__(self, input_ids, /, **kwargs):
        self.calls += 1
        return self.draft(input_ids, **kwargs)


def sampling_args(temperature: float) -> dict:
    """``Llama.generate``'s sampler settings: greedy at 0 (``top_k=1``); otherwise the whole distribution at
    ``temperature`` (top-k, top-p, min-p and typical sampling off), as our methods and HF's sample.
    Repeat penalty off in both."""
    if temperature == 0:
        return dict(temp=0.0, top_k=1, repeat_penalty=1.0)
    return dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)


@dataclass
class Decoded:
    """One prompt's new tokens and, with a draft model, each verify step's emitted count."""

    tokens: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)


class LlamaCppRunner:
    """A ``llama_cpp.Llama`` on the target's GGUF file; one prompt per call (llama.cpp serves one sequence
    per context here). ``step_s`` holds each call's time per generated token, as for HF."""

    def __init__(self, spec: MethodSpec, llama, draft: CountingDraft | None, gguf: Path):
        self.spec, self.llama, self.draft, self.gguf = spec, llama, draft, Path(gguf)
        self.modules = ()

    @classmethod
    def load(cls, spec: MethodSpec, gguf: Path, n_ctx: int, threads: int) -> "LlamaCppRunner":
        """Load ``gguf`` into a context of ``n_ctx`` tokens (the longest prompt plus the new tokens) that
        computes on ``threads`` threads, prefill included; with ``spec.prompt_lookup_tokens``, llama.cpp's
        prompt lookup proposes that many drafts a step, and the context holds that many more (a step
        evaluates its drafts past the last token it keeps)."""
        from llama_cpp import Llama

        draft = None
        if spec.prompt_lookup_tokens:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = CountingDraft(LlamaPromptLookupDecoding(num_pred_tokens=spec.prompt_lookup_tokens))
        llama = Llama(model_path=os.fspath(gguf), n_ctx=n_ctx + (spec.prompt_lookup_tokens or 0), n_threads=threads, n_threads_batch=threads,
                      draft_model=draft, verbose=False)
        return cls(spec, llama, draft, gguf)

    def describe(self) -> dict:
        return {**self.spec.describe(), "gguf": str(self.gguf), "exact": False}

    def lookup_costs(self) -> None:
        """None: llama.cpp's prompt lookup measures no verify costs (``Runner.lookup_costs``)."""
        return None

    def weight_bytes(self) -> int:
        """The GGUF file's size: llama.cpp maps its weights from the file as they are."""
        return self.gguf.stat().st_size

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> CallResult:
        """``max_new_tokens`` new tokens of each of ``prompts``, one ``decode`` each (timed alone)."""
        out = CallResult()
        for i, prompt in enumerate(prompts):
            if temperature > 0:
                self.llama.set_seed(prompt_seed(seed, i) % LLAMA_SEED_LIMIT)
            with Stopwatch(torch.device("cpu")) as sw:
                decoded = self.decode(prompt, max_new_tokens, temperature)
            if len(decoded.tokens) != max_new_tokens:
                raise RuntimeError(f"{self.spec.key}: llama.cpp generated {len(decoded.tokens)} tokens, "
                                   f"expected {max_new_tokens}")
            out.tokens.append(decoded.tokens)
            out.accepted_lengths.extend(decoded.accepted_lengths)
            out.step_s.append(sw.seconds / max_new_tokens)
            out.seconds += sw.seconds
        return out

    def decode(self, prompt: list[int], max_new_tokens: int, temperature: float) -> Decoded:
        """Iterate ``Llama.generate`` over ``prompt`` and stop it after ``max_new_tokens`` tokens (it never
        stops by itself: EOS is ignored, as for every method)."""
        # A full prefill every call, as our methods and HF's do: reset() drops the KV cache's prefix that
        # generate() would otherwise reuse from the previous prompt (the chat template's, at least).
        self.llama.reset()
        if self.draft is not None:
            self.draft.calls = 0
        out, steps = Decoded(), []   # steps[j]: the draft calls made before token j was yielded
        for token in self.llama.generate(prompt, **sampling_args(temperature)):
            out.tokens.append(int(token))
            if self.draft is not None:
                steps.append(self.draft.calls)
            if len(out.tokens) == max_new_tokens:
                break
        # the prefill's token comes before the first draft call: it is not a step (as for our methods)
        per_call = Counter(steps)
        out.accepted_lengths = [per_call[c] for c in range(1, max(steps, default=0) + 1)]
        return out
