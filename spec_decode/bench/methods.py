"""Runners: one object per method key with the same ``generate`` call, ours, Hugging Face's and llama.cpp's
(``spec_decode.bench.anchor``).

Every runner generates exactly ``max_new_tokens`` tokens per prompt: EOS stopping is disabled for
all methods (``generate(ignore_eos=True)`` and no stop ids for ours; ``eos_token_id=None``, in the call and
in the model's ``generation_config``, for HF; llama.cpp's token generator stopped after that many), so
tokens/s compares equal work.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_decode.bench.config import DRAFTER_OPTIONS, BenchInputError, MethodSpec, fit_seed, load_prompts
from spec_decode.bench.machine import Stopwatch, weight_bytes
from spec_decode.bench.runner import CallResult, prompt_seed
from spec_decode.dtypes import torch_dtype

BENCH_NAN_POLICY = "guard"   # the library default, pinned so that $SAFESPEC_NAN_POLICY cannot move the numbers
DRAFTER_METHODS = {"draft_lm": "draft_model", "eagle": "eagle", "eagle3": "eagle3"}
"""``SpecDecoder`` method of each drafter checkpoint name (``MethodSpec.drafter``)."""
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError)
"""What loading a bad checkpoint raises (missing/unreadable files, bad configs, mismatched shapes)."""


def checked_load(option: str, path, load):
    """``load()``, with a loading error turned into a BenchInputError that names ``option`` and ``path``."""
    try:
        return load()
    except LOAD_ERRORS as e:
        raise BenchInputError(f"{option} {path}: {e}") from e


class OursRunner:
    """A ``SpecDecoder``; one ``generate`` call per batch of prompts."""

    def __init__(self, spec: MethodSpec, decoder, modules: tuple):
        self.spec, self.decoder, self.modules = spec, decoder, modules

    def weight_bytes(self) -> int:
        """Bytes of the models' weights, storage the head shares with the target counted once."""
        return weight_bytes(*self.modules)

    def describe(self) -> dict:
        """The method's settings as the decoder holds them (``num_steps`` may be ``"auto"``)."""
        d = self.spec.describe()
        d["batch_invariant"] = self.decoder.batch_invariant
        if self.spec.speculative:
            d.update(num_steps=self.decoder.num_steps, draft_sampling=self.decoder.draft_sampling)
            if self.decoder.num_steps == "auto":
                d["max_steps"] = self.decoder.max_steps
            if self.decoder.lookup_ngram:
                d["lookup_tokens"] = self.decoder.lookup_tokens
                if self.decoder.lookup_auto is not None:
                    d["lookup_max_tokens"] = self.decoder.lookup_max_drafts
        return d

    def lookup_costs(self) -> dict[str, float] | None:
        """Under ``lookup_tokens="auto"``, once a call ran: the verify costs its choice read (rows -> cost
        relative to one row, ``SpecDecoder.lookup_costs``); else None."""
        costs = self.decoder.lookup_costs
        return None if costs is None else {str(n): c for n, c in costs.items()}

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> CallResult:
        with Stopwatch(self.decoder.target.device) as sw:
            results = self.decoder.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                            seed=seed if temperature > 0 else None, ignore_eos=True)
        accepted = [n for r in results for n in r.accepted_lengths] if self.spec.speculative else []
        return CallResult([r.token_ids for r in results], accepted, list(self.decoder.last_stats.step_s),
                          sw.seconds)


class HFRunner:
    """``transformers`` ``generate`` (optionally assisted), one prompt per call.

    Assisted generation supports batch size 1 only, so both HF methods run one prompt per call.
    ``step_s`` holds each call's time per generated token (HF has no per-step hook).
    """

    def __init__(self, spec: MethodSpec, model, assistant=None):
        self.spec, self.model, self.assistant = spec, model, assistant
        self.modules = (model,) if assistant is None else (model, assistant)

    def describe(self) -> dict:
        return self.spec.describe()

    def lookup_costs(self) -> None:
        """None: HF's prompt lookup measures no verify costs (``OursRunner.lookup_costs``)."""
        return None

    weight_bytes = OursRunner.weight_bytes

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> CallResult:
        out = CallResult()
        device = self.model.device
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device=device)
            if temperature > 0:
                torch.manual_seed(fit_seed(prompt_seed(seed, i)))
            extra = {} if self.assistant is None else {"assistant_model": self.assistant}
            if self.spec.prompt_lookup_tokens:
                extra["prompt_lookup_num_tokens"] = self.spec.prompt_lookup_tokens
            with torch.inference_mode(), Stopwatch(device) as sw:
                seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          eos_token_id=None, pad_token_id=0, **sampling, **extra)
            new = seq[0, ids.shape[1]:].tolist()
            if len(new) != max_new_tokens:
                raise RuntimeError(f"{self.spec.key}: HF generated {len(new)} tokens, expected {max_new_tokens}")
            out.tokens.append(new)
            out.step_s.append(sw.seconds / len(new))
            out.seconds += sw.seconds
        return out


class ModelCache:
    """Loads each checkpoint once per dtype and shares it between runners (the target especially)."""

    def __init__(self, cfg, dtype_name: str, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, torch_dtype(dtype_name), device
        self._models: dict[str, object] = {}

    def get(self, name: str):
        if name not in self._models:
            self._models[name] = self._load(name)
        return self._models[name]

    def _load(self, name: str):
        """Load checkpoint ``name``; a bad checkpoint raises BenchInputError naming its option."""
        from spec_decode.models.eagle import load_drafter
        from spec_decode.models import Transformer

        cfg, dtype, device = self.cfg, self.dtype, self.device
        if name == "target":
            return checked_load("--target", cfg.target,
                                lambda: Transformer.from_pretrained(cfg.target, dtype=dtype, device=device))
        if name in DRAFTER_METHODS:
            path, target = cfg.drafter_path(name), self.get("target")
            return checked_load(DRAFTER_OPTIONS[name], path, lambda: load_drafter(
                path, target, method=DRAFTER_METHODS[name], dtype=dtype, device=device))
        if name in ("hf_target", "hf_draft_lm"):
            option, path = ("--target", cfg.target) if name == "hf_target" else ("--draft-lm", cfg.draft_lm)
            return checked_load(option, path, lambda: _load_hf(path, dtype, device))
        raise KeyError(name)

    def runner(self, spec: MethodSpec, nan_policy: str = BENCH_NAN_POLICY):
        """The runner of ``spec`` (our decoders share the loaded target and drafter)."""
        from spec_decode.pipeline import SpecDecoder

        if spec.engine == "hf":
            assistant = self.get("hf_draft_lm") if spec.drafter else None
            return HFRunner(spec, self.get("hf_target"), assistant)
        if spec.engine == "llama_cpp":
            return self._llama_cpp_runner(spec)
        target = self.get("target")
        drafter = self.get(spec.drafter) if spec.drafter else None
        tree = {} if drafter is None else dict(num_steps=spec.num_steps, topk=spec.topk,
                                               num_draft_tokens=spec.num_draft_tokens)
        if drafter is not None and spec.score_temperature is not None:
            tree["tree_score_temperature"] = spec.score_temperature
        if spec.lookup_ngram is not None:
            tree["lookup_ngram"] = spec.lookup_ngram
        if spec.lookup_tokens is not None:
            tree["lookup_tokens"] = spec.lookup_tokens
        if spec.lookup_max_tokens is not None:
            tree["lookup_max_tokens"] = spec.lookup_max_tokens
        if spec.draft_sampling is not None:
            tree["draft_sampling"] = spec.draft_sampling
        dec = SpecDecoder(target, drafter, method=spec.method, nan_policy=nan_policy, compile=self.cfg.compile, **tree)
        return OursRunner(spec, dec, (target, drafter))


    def _llama_cpp_runner(self, spec: MethodSpec):
        """llama.cpp on ``cfg.gguf``, its context as long as the longest prompt read plus the new tokens, on
        the run's threads (``--threads``, else torch's). A broken install raises BenchInputError naming
        ``--methods``."""
        from spec_decode.bench.anchor import LlamaCppRunner
        from spec_decode.bench.args import ANCHOR_INSTALL

        cfg = self.cfg
        prompts = load_prompts(Path(cfg.prompts), cfg.num_prompts, self.get("target").config.vocab_size)
        n_ctx = max(map(len, prompts)) + cfg.max_new_tokens
        try:
            return checked_load("--target", cfg.gguf, lambda: LlamaCppRunner.load(
                spec, cfg.gguf, n_ctx, cfg.threads or torch.get_num_threads()))
        except ImportError as e:   # found but not importable: its shared library failed to load
            raise BenchInputError(f"--methods {spec.key}: llama-cpp-python does not import ({e}); "
                                  f"{ANCHOR_INSTALL}") from e


def _load_hf(path: Path, dtype: torch.dtype, device: torch.device):
    """``AutoModelForCausalLM`` in ``dtype`` with EOS stopping disabled (exactly max_new_tokens tokens)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:   # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    # generate() falls back to the checkpoint's generation_config for unset fields: clear EOS there too.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()
