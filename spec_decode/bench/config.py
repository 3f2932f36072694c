"""Benchmark configuration: the method table and the validated run settings."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from spec_decode.fixtures import find_fixtures_dir, missing_fixtures_hint
from spec_decode.seeds import SEED_LIMIT

# Keys of results.json["methods"]; the order is the order of the table and the figure.
COUPLED_TWINS = ("eagle_chain", "eagle_tree", "eagle_auto", "eagle_lookup", "eagle3_tree")
"""EAGLE methods that also run as ``KEY_coupled``: the same shape with ``draft_sampling="coupled"``."""
DEFAULT_METHODS = ("ar", "hf_generate", "hf_assisted", "draft_chain", "eagle_chain", "eagle_tree", "eagle_auto",
                   "eagle_lookup", "eagle3_tree") + tuple(f"{k}_coupled" for k in COUPLED_TWINS)
"""What ``spec-bench`` runs unless ``--methods`` says otherwise."""
EXTRA_COUPLED_TWINS = ("lookup", "eagle3_chain", "eagle3_lookup")
"""The real model's methods that also run as ``KEY_coupled`` (outside ``spec-bench``'s default set): under
coupled sampling a sampled request's tokens do not depend on its drafts, so lookup steps serve it too."""
ANCHOR_METHODS = ("llama_cpp", "llama_cpp_lookup")
"""llama.cpp on the GGUF file the target was converted from (``spec_decode.bench.anchor``): the anchor column."""
METHOD_KEYS = DEFAULT_METHODS + ("lookup", "hf_lookup", "eagle3_chain", "eagle3_lookup") + tuple(
    f"{k}_coupled" for k in EXTRA_COUPLED_TWINS) + ANCHOR_METHODS
BENCH_DTYPES = ("fp32", "bf16")
"""The dtypes the bench measures, of ``dtype_names.DTYPE_NAMES`` (fp16 runs in the tests and
``tools/smollm2_fp16.py``, not in the bench)."""
NAN_MODES = ("off", "sanitize", "abort", "guard")   # "off" first: the baseline of the NaN-policy stage
DEFAULT_NUM_PROMPTS = 16
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class MethodSpec:
    """How one method key runs.

    ``engine`` is ``"ours"`` (``SpecDecoder``), ``"hf"`` (``transformers`` ``generate``) or ``"llama_cpp"``
    (``llama-cpp-python``'s ``Llama.generate`` on the target's GGUF file, ``spec_decode.bench.anchor``);
    ``method`` is the ``SpecDecoder`` method; ``drafter`` names the checkpoint it needs
    (``"draft_lm"``, ``"eagle"``, ``"eagle3"`` or None). A chain is ``topk=1`` with
    ``num_draft_tokens = num_steps + 1`` (root included); ``num_steps="auto"`` lets the decoder
    choose the depth per step. ``score_temperature``: ``SpecDecoder(tree_score_temperature=...)``
    (None: the library's default, 1.0). ``lookup_ngram``: ``SpecDecoder(lookup_ngram=...)`` (None: off),
    greedy steps that verify drafts copied from the request's context where its last n-gram occurred
    before (``spec_decode.lookup``); ``lookup_tokens``: ``SpecDecoder(lookup_tokens=...)``, the most drafts
    such a step verifies, or ``"auto"`` (None: the library's default); ``lookup_max_tokens``:
    ``SpecDecoder(lookup_max_tokens=...)``, the cap of ``"auto"``'s choice (None: the library's). ``draft_sampling``: ``SpecDecoder(draft_sampling=...)``
    (None: the library's default); the ``_coupled`` twins set ``"coupled"``, which changes nothing at temperature 0.
    ``prompt_lookup_tokens``: the drafts a step of another engine's prompt lookup proposes: HF
    ``generate(prompt_lookup_num_tokens=...)``, llama.cpp ``LlamaPromptLookupDecoding(num_pred_tokens=...)``.
    """

    key: str
    engine: str
    method: str | None = None
    drafter: str | None = None
    num_steps: int | str | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    score_temperature: float | None = None
    lookup_ngram: int | None = None
    lookup_tokens: int | str | None = None
    lookup_max_tokens: int | None = None
    draft_sampling: str | None = None
    prompt_lookup_tokens: int | None = None

    @property
    def speculative(self) -> bool:
        """Whether our decoder verifies drafts: a drafter's, or prompt lookup's."""
        return self.engine == "ours" and (self.method != "none" or bool(self.lookup_ngram))

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "key"}


LOOKUP_TOKENS = 11
"""The most drafts an ``eagle3_lookup`` step verifies (``lookup_max_tokens``): its ``lookup_tokens="auto"``
chooses each step's count up to it from the verify costs measured on the machine that runs it
(``spec_decode.lookup_choice``), so a CPU whose projection kernel takes a smaller row block than the
cap's never pays a block that costs more than the drafts it accepts. ``lookup`` alone keeps the
library's fixed 8 (docs/performance.md)."""

# The tree `spec-bench tune` picks on CPU: 4/2/8 with its candidates scored at temperature 0.5 (the run
# and its figures: docs/results/, "trees scored at a temperature")
_EAGLE_TREE = MethodSpec("eagle_tree", "ours", "eagle", "eagle", 4, 2, 8, score_temperature=0.5)
METHOD_SPECS = {
    "ar": MethodSpec("ar", "ours", "none"),
    "hf_generate": MethodSpec("hf_generate", "hf"),
    "hf_assisted": MethodSpec("hf_assisted", "hf", drafter="draft_lm"),
    "draft_chain": MethodSpec("draft_chain", "ours", "draft_model", "draft_lm", 4, 1, 5),
    "eagle_chain": MethodSpec("eagle_chain", "ours", "eagle", "eagle", 4, 1, 5),
    "eagle_tree": _EAGLE_TREE,
    # a chain up to depth 6 (the CPU winner's form), its depth chosen per step by the decoder
    # (SpecDecoder(num_steps="auto")), down to a plain target step
    "eagle_auto": MethodSpec("eagle_auto", "ours", "eagle", "eagle", "auto", 1, 7),
    # the chain that wins `spec-bench tune` on CPU (5/1/6), with lookup steps where a greedy request's
    # last 3 tokens occurred before in its context (prompt lookup; 8 drafts a step at most)
    "eagle_lookup": MethodSpec("eagle_lookup", "ours", "eagle", "eagle", 5, 1, 6, lookup_ngram=3),
    "eagle3_tree": MethodSpec("eagle3_tree", "ours", "eagle3", "eagle3", 4, 2, 8, score_temperature=0.5),
    # the EAGLE-3 chain, alone and with lookup steps (as eagle_lookup): the real model's heads run them, in
    # the shape `spec-bench tune` picked for the SmolLM2 head on CPU (docs/performance.md)
    "eagle3_chain": MethodSpec("eagle3_chain", "ours", "eagle3", "eagle3", 3, 1, 4),
    # Lookup steps verify the drafts the measured verify costs pay for, up to LOOKUP_TOKENS
    "eagle3_lookup": MethodSpec("eagle3_lookup", "ours", "eagle3", "eagle3", 3, 1, 4, lookup_ngram=3,
                                lookup_tokens="auto", lookup_max_tokens=LOOKUP_TOKENS),
    # prompt lookup alone (no drafter): greedy steps verify up to 8 tokens (the library's default) copied
    # from where the last 3 tokens occurred before in the context; sampled requests decode one token a step
    "lookup": MethodSpec("lookup", "ours", "none", lookup_ngram=3),
    # HF's prompt lookup with the value its docs show (10 candidate tokens); it samples too
    "hf_lookup": MethodSpec("hf_lookup", "hf", prompt_lookup_tokens=10),
    # llama.cpp on the same GGUF file: plain decoding, and its prompt lookup with num_pred_tokens=10,
    # LlamaPromptLookupDecoding's default (llama-cpp-python's README suggests 2 on CPU-only machines; the
    # default keeps it beside hf_lookup's 10)
    "llama_cpp": MethodSpec("llama_cpp", "llama_cpp"),
    "llama_cpp_lookup": MethodSpec("llama_cpp_lookup", "llama_cpp", prompt_lookup_tokens=10),
}
METHOD_SPECS.update({f"{k}_coupled": replace(METHOD_SPECS[k], key=f"{k}_coupled", draft_sampling="coupled")
                     for k in COUPLED_TWINS + EXTRA_COUPLED_TWINS})


DRAFTER_OPTIONS = {"draft_lm": "--draft-lm", "eagle": "--eagle", "eagle3": "--eagle3"}
"""The command-line option of each drafter checkpoint (``MethodSpec.drafter`` -> option)."""


class BenchInputError(ValueError):
    """Bad input to ``spec-bench``; the message starts with the option at fault (the CLI exits with status 2)."""


def default_dtype_name(device_type: str) -> str:
    """The dtype a run uses unless ``--dtype`` says otherwise: bf16 on CUDA, fp32 on CPU (where bf16
    matmuls are slow without native support)."""
    return "bf16" if device_type == "cuda" else "fp32"


def fit_seed(seed: int, rows: int = 1) -> int:
    """``seed`` folded into the library's range for a call of ``rows`` prompts (prompt ``i`` gets ``seed + i``,
    which must stay below 2**63); unchanged when it fits, so small seeds reproduce as before."""
    return seed % (SEED_LIMIT - rows + 1)


def check_room(max_new_tokens: int, positions: int, prompts, option: str = "--max-new-tokens") -> None:
    """Raise BenchInputError naming ``option`` when the longest of ``prompts`` plus ``max_new_tokens`` new tokens
    exceeds the target's ``positions`` (``max_position_embeddings``): the library would refuse the call."""
    longest = max(map(len, prompts), default=0)
    if longest + max_new_tokens > positions:
        fits = f"; at most {positions - longest} fit" if positions > longest else ""
        raise BenchInputError(f"{option} {max_new_tokens}: the longest prompt read has {longest} tokens, and "
                              f"{longest} + {max_new_tokens} exceeds the target's max_position_embeddings "
                              f"({positions}){fits}")


def check_checkpoint_dir(option: str, path) -> None:
    """BenchInputError naming ``option`` when ``path`` is not a directory, with how to point at the fixtures
    (``$SAFESPEC_FIXTURES_DIR`` named when it is set): the default paths come from it."""
    if not Path(path).is_dir():
        raise BenchInputError(f"{option}: no checkpoint directory at {path}{missing_fixtures_hint()}")


def check_prompts_file(path) -> None:
    """BenchInputError naming ``--prompts`` when ``path`` is missing (with the fixtures hint) or is not a
    regular file (a directory, ``/dev/null``)."""
    if not Path(path).exists():
        raise BenchInputError(f"--prompts: no file at {path}{missing_fixtures_hint()}")
    if not Path(path).is_file():
        raise BenchInputError(f"--prompts: {path} is not a regular file; give a JSONL file with 'token_ids' per line")


def default_fixtures_dir() -> Path:
    """The shipped fixtures (``spec_decode.fixtures.find_fixtures_dir``), else ``./fixtures`` so that errors name it."""
    return find_fixtures_dir() or Path("fixtures")


def check_out_dir(path: Path, option: str = "--out", outputs: tuple[str, ...] = ()) -> Path:
    """Create the output directory ``path`` and check that a file can be written there.

    Raises BenchInputError naming ``option`` when ``path`` is a file, lies under one, or is not writable, or
    when one of the files the run writes there (``outputs``, and the ``.tmp`` each is written through first)
    is a directory: found before the run, not after it.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BenchInputError(f"{option} {path}: is a file, not a directory")
    taken = [name for out in outputs for name in (out, out + ".tmp") if (path / name).is_dir()]
    if taken:
        raise BenchInputError(f"{option} {path}: {path / taken[0]} is a directory; the run writes a file there")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # os.access says yes to root even on a read-only mount: write a file to know.
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise BenchInputError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    return path


@dataclass
class BenchConfig:
    """Validated settings of one ``spec-bench`` run (the CLI builds it; scripts may too).

    ``dtypes[0]`` is the headline dtype (top-level ``methods``); further dtypes go to
    ``results["by_dtype"]``. ``batch_size`` is prompts per ``generate`` call of our methods
    (1 = the latency setting); HF methods always run one prompt per call.
    Raises ValueError naming the field on bad values.
    """

    target: Path
    draft_lm: Path | None
    eagle: Path | None
    eagle3: Path | None
    prompts: Path
    out: Path = Path("bench_out")
    methods: tuple[str, ...] = DEFAULT_METHODS
    num_prompts: int = DEFAULT_NUM_PROMPTS
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    dtypes: tuple[str, ...] = ("fp32",)
    batch_size: int = 1
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    nan_rounds: int = 3
    progress: bool = True
    compile: bool = False   # SpecDecoder(compile=True) for every method of ours, ar included
    gguf: Path | None = None   # the GGUF file the anchor methods run (the target's source), None: they are skipped
    skipped: dict = field(default_factory=dict)   # method key -> reason, filled by ``resolve_methods``

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHOD_SPECS]
        if unknown or not self.methods:
            raise ValueError(f"--methods: unknown or empty {unknown or list(self.methods)}; "
                             f"choose from {','.join(METHOD_KEYS)}")
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.batch_size > self.num_prompts:
            raise ValueError(f"--batch-size {self.batch_size} exceeds --num-prompts {self.num_prompts}: a batch "
                             "holds at most every measured prompt")
        for name, values in (("methods", self.methods), ("dtype", self.dtypes), ("temperatures", self.temperatures)):
            if len(set(values)) != len(values):
                raise ValueError(f"--{name}: a value is listed twice in {list(values)}")
        if self.nan_rounds < 0:
            raise ValueError(f"--nan-rounds must be >= 0, got {self.nan_rounds}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        bad = [t for t in self.temperatures if not (t >= 0 and t != float("inf"))]
        if bad or not self.temperatures:
            raise ValueError(f"--temperatures must be finite numbers >= 0, got {list(self.temperatures)}")
        bad = [d for d in self.dtypes if d not in BENCH_DTYPES]
        if bad or not self.dtypes:
            raise ValueError(f"--dtype must be a comma list of {BENCH_DTYPES}, got {list(self.dtypes)}")
        check_checkpoint_dir("--target", self.target)
        check_prompts_file(self.prompts)
        try:
            with open(self.prompts, encoding="utf-8") as f:
                available = sum(1 for line in f if line.strip())
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts: cannot read {self.prompts} as text ({e})") from None
        if self.num_prompts > available:
            raise ValueError(f"--num-prompts {self.num_prompts} exceeds the {available} prompts in {self.prompts}")

    def resolve_methods(self) -> tuple[str, ...]:
        """Drop methods whose drafter checkpoint is absent, or (the anchor's) whose GGUF file is unknown,
        recording why in ``skipped``."""
        kept = []
        for key in self.methods:
            if METHOD_SPECS[key].engine == "llama_cpp" and self.gguf is None:
                self.skipped[key] = "no GGUF file: llama.cpp runs the .gguf file given as --target"
                continue
            need = METHOD_SPECS[key].drafter
            path = self.drafter_path(need) if need else None
            if need and (path is None or not Path(path).is_dir()):
                self.skipped[key] = f"no {need} checkpoint ({DRAFTER_OPTIONS[need]} {path})"
                continue
            kept.append(key)
        return tuple(kept)

    def drafter_path(self, name: str) -> Path | None:
        """The checkpoint path of drafter ``name`` (``"draft_lm"``, ``"eagle"``, ``"eagle3"``)."""
        return {"draft_lm": self.draft_lm, "eagle": self.eagle, "eagle3": self.eagle3}[name]

    def to_json(self) -> dict:
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        d["methods"] = list(self.methods)
        return json.loads(json.dumps(d, default=str))


def load_prompts(path: Path, n: int, vocab_size: int, first: int = 0) -> list[list[int]]:
    """Token ids of ``n + 1`` prompts from the ``first``-th on (the extra one is the warm-up prompt when present).

    Raises BenchInputError (a ValueError) naming ``--prompts`` when there is no such file, or naming it and
    the line when a line lacks ``token_ids`` or an id lies outside ``[0, vocab_size)``, and naming
    ``--num-prompts`` when the file holds fewer than ``first + n`` prompts.
    """
    check_prompts_file(path)
    prompts = []
    skip = first
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["token_ids"]
            except (KeyError, TypeError, json.JSONDecodeError):
                raise BenchInputError(f"--prompts: {path}:{lineno} is not a JSON object with 'token_ids'") from None
            if not isinstance(ids, list) or not ids or any(
                    type(t) is not int or not 0 <= t < vocab_size for t in ids):   # type(): bool is no id
                raise BenchInputError(f"--prompts: {path}:{lineno} 'token_ids' must be a non-empty list of ints in "
                                      f"[0, {vocab_size}) (the target's vocabulary)")
            if skip:
                skip -= 1
                continue
            prompts.append(ids)
            if len(prompts) > n:
                break
    if len(prompts) < n:
        where = f" from prompt {first} on" if first else ""
        raise BenchInputError(f"--num-prompts {n} exceeds the {len(prompts)} prompts{where} in {path}")
    return prompts
