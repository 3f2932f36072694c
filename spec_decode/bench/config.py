"""Benchmark configuration: the method table and the validated run settings."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Keys of results.json["methods"]; the order is the order of the table and the figure.
METHOD_KEYS = ("ar", "hf_generate", "hf_assisted", "draft_chain", "eagle_chain", "eagle_tree", "eagle3_tree")
DTYPE_NAMES = ("fp32", "bf16")
NAN_MODES = ("off", "sanitize", "abort")
DEFAULT_NUM_PROMPTS = 16
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class MethodSpec:
    """How one method key runs.

    ``engine`` is ``"ours"`` (``SpecDecoder``) or ``"hf"`` (``transformers`` ``generate``);
    ``method`` is the ``SpecDecoder`` method; ``drafter`` names the checkpoint it needs
    (``"draft_lm"``, ``"eagle"``, ``"eagle3"`` or None). A chain is ``topk=1`` with
    ``num_draft_tokens = num_steps + 1`` (root included).
    """

    key: str
    engine: str
    method: str | None = None
    drafter: str | None = None
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None

    @property
    def speculative(self) -> bool:
        return self.engine == "ours" and self.method != "none"

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "key"}


METHOD_SPECS = {
    "ar": MethodSpec("ar", "ours", "none"),
    "hf_generate": MethodSpec("hf_generate", "hf"),
    "hf_assisted": MethodSpec("hf_assisted", "hf", drafter="draft_lm"),
    "draft_chain": MethodSpec("draft_chain", "ours", "draft_model", "draft_lm", 4, 1, 5),
    "eagle_chain": MethodSpec("eagle_chain", "ours", "eagle", "eagle", 4, 1, 5),
    "eagle_tree": MethodSpec("eagle_tree", "ours", "eagle", "eagle", 5, 4, 8),
    "eagle3_tree": MethodSpec("eagle3_tree", "ours", "eagle3", "eagle3", 5, 4, 8),
}


def default_fixtures_dir() -> Path:
    """The repository's ``fixtures/`` (``$SAFESPEC_FIXTURES_DIR`` wins), found relative to this file."""
    import os

    env = os.environ.get("SAFESPEC_FIXTURES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "fixtures"


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
    methods: tuple[str, ...] = METHOD_KEYS
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
        if self.nan_rounds < 0:
            raise ValueError(f"--nan-rounds must be >= 0, got {self.nan_rounds}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        bad = [t for t in self.temperatures if not (t >= 0 and t != float("inf"))]
        if bad or not self.temperatures:
            raise ValueError(f"--temperatures must be finite numbers >= 0, got {list(self.temperatures)}")
        bad = [d for d in self.dtypes if d not in DTYPE_NAMES]
        if bad or not self.dtypes:
            raise ValueError(f"--dtype must be a comma list of {DTYPE_NAMES}, got {list(self.dtypes)}")
        if not Path(self.target).is_dir():
            raise ValueError(f"--target: no checkpoint directory at {self.target}")
        if not Path(self.prompts).is_file():
            raise ValueError(f"--prompts: no file at {self.prompts}")
        with open(self.prompts) as f:
            available = sum(1 for line in f if line.strip())
        if self.num_prompts > available:
            raise ValueError(f"--num-prompts {self.num_prompts} exceeds the {available} prompts in {self.prompts}")

    def resolve_methods(self) -> tuple[str, ...]:
        """Drop methods whose drafter checkpoint is absent, recording why in ``skipped``."""
        paths = {"draft_lm": self.draft_lm, "eagle": self.eagle, "eagle3": self.eagle3}
        flags = {"draft_lm": "--draft-lm", "eagle": "--eagle", "eagle3": "--eagle3"}
        kept = []
        for key in self.methods:
            need = METHOD_SPECS[key].drafter
            path = paths.get(need) if need else None
            if need and (path is None or not Path(path).is_dir()):
                self.skipped[key] = f"no {need} checkpoint ({flags[need]} {path})"
                continue
            kept.append(key)
        return tuple(kept)

    def to_json(self) -> dict:
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        d["methods"] = list(self.methods)
        return json.loads(json.dumps(d, default=str))


def load_prompts(path: Path, n: int, vocab_size: int) -> list[list[int]]:
    """The first ``n + 1`` prompts' token ids (the extra one is the warm-up prompt when present).

    Raises ValueError naming the file when it holds fewer than ``n`` prompts, a line lacks
    ``token_ids`` or an id lies outside ``[0, vocab_size)``.
    """
    prompts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["token_ids"]
            except (KeyError, TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"--prompts: {path}:{lineno} is not a JSON object with 'token_ids'") from e
            if not ids or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"--prompts: {path}:{lineno} has an empty prompt or ids outside "
                                 f"[0, {vocab_size})")
            prompts.append(ids)
            if len(prompts) > n:
                break
    if len(prompts) < n:
        raise ValueError(f"--num-prompts {n} exceeds the {len(prompts)} prompts in {path}")
    return prompts
