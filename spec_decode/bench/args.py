"""The checks of ``spec-bench``'s option values and the options its subcommands share: one place for each rule.

Every value is checked when the command line is parsed, before any checkpoint is read: each function
here named for a kind of value is an argparse ``type=``, and a bad value raises ArgumentTypeError,
which argparse reports on one line naming the option as the user typed it
(``spec-bench tune: error: argument --seed: ...``) with exit status 2.

Rules (the same in every subcommand):

* counts (``--num-prompts``, ``--max-new-tokens``, ``--threads``, ``--batch-size``, ...) are integers >= 1
  (``positive_int``); ``--nan-rounds``, ``--cprofile``, ``--first-prompt``: integers >= 0 (``nonneg_int``);
* temperatures are finite numbers >= 0 (``nonneg_float``), taken as the float32 the library holds them in:
  one that rounds to 0 there (``1e-46``) is 0, greedy, as in ``generate``; times are finite and > 0
  (``positive_float``): a NaN time limit never ends;
* sizes that allocate or run for as long as they say have an upper bound (``at_most``): ``--threads`` at most
  the machine's CPUs, ``numerics --rows``/``--vocabs``/``--min-run-time`` their module's limits;
* seeds are integers in [0, 2**63) (``seed``), the library's range;
* comma lists (``csv_list``) are non-empty, with no empty item and no item twice: ``ar,,eagle_chain`` is a
  typo, not two methods, and a repeated method or dtype would be measured twice under one key;
* ``--device`` (``device``): ``auto``, ``cpu`` (no index: there is one CPU device) or ``cuda[:N]`` with a
  present ``N``;
* ``--json`` (``new_file``): a file whose directory exists and that can be written, checked before the run it
  would end (a device such as ``/dev/full`` fails only on writing: exit 2 naming ``--json``, the results printed);
* ``--out`` (``out_dir``): a non-empty path (an empty one would write into the working directory); a file
  the run writes there must not be a directory (``config.check_out_dir``), checked before the run.

This module imports nothing of the benchmark's but ``config`` and ``fixtures``, so that the
subcommands and ``cli`` can all import it without importing one another.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path

from spec_decode.bench.config import ANCHOR_METHODS, BENCH_DTYPES, BenchInputError, default_fixtures_dir
from spec_decode.seeds import SEED_LIMIT
from spec_decode.fixtures import DRAFT_SUBDIR, EAGLE3_SUBDIR, EAGLE_SUBDIR, PROMPTS_FILE, TARGET_SUBDIR

DEVICES = "auto, cpu, cuda or cuda:N"


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _int(text, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonneg_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _finite(text: str, what: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a temperature), as the float32 the samplers hold it in: one that
    rounds to 0 there is 0.0 (greedy, as the library takes it), so ``0,1e-46`` is one temperature twice; one
    past float32's range (``1e39``) is an error, as the library would raise mid-run."""
    from samplers.params import float32_value

    value = _finite(text, "a finite number >= 0")
    if value < 0 or math.isinf(float32_value(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 in float32, got {text!r}")
    return 0.0 if float32_value(value) == 0 else value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a time limit; NaN would never be reached)."""
    value = _finite(text, "a finite number > 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def at_most(kind, limit, why: str = ""):
    """An argparse type: a value of ``kind`` (``positive_int``, ``positive_float``...) no larger than ``limit``."""
    def parse(text: str):
        value = kind(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit:g}{why}, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def seed(text: str) -> int:
    """An argparse type: an integer in [0, 2**63), the library's seed range."""
    value = _int(text, "an integer in [0, 2**63)")
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def csv_list(kind=str, choices=None):
    """An argparse type: a comma list of ``kind`` (a type such as ``positive_int``) as a tuple.

    The list must be non-empty, hold no empty item and no value twice (``"0,0.0"`` is one temperature
    twice), and each item must be one of ``choices`` when given.
    """
    def parse(text: str) -> tuple:
        items = [s.strip() for s in text.split(",")]
        if not any(items):
            of = f" of {','.join(choices)}" if choices else ""
            raise argparse.ArgumentTypeError(f"expected a comma list{of}, got {text!r}")
        if not all(items):
            raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
        values = tuple(_item(kind, s, text) for s in items)
        if choices is not None:
            unknown = [v for v in values if v not in choices]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose from "
                                                 f"{','.join(choices)}")
        twice = sorted({repr(v) for i, v in enumerate(values) if v in values[:i]})
        if twice:
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} listed twice in {text!r}")
        return values
    return parse


def _item(kind, item: str, text: str):
    try:
        return kind(item)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(e if item == text.strip() else f"{e} in {text!r}") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None


def device(text: str):
    """An argparse type: the torch device of ``auto`` (CUDA when available, else CPU), ``cpu`` or a present
    ``cuda[:N]``."""
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use {DEVICES}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: spec-bench runs on cpu or cuda")
    if dev.type == "cpu" and dev.index is not None:
        raise argparse.ArgumentTypeError(f"{text}: cpu takes no device index; use cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def out_dir(text: str) -> Path:
    """An argparse type: an output directory's path, not empty (``Path("")`` is the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a directory (. for the working directory)")
    return Path(text)


def new_file(text: str) -> Path:
    """An argparse type: a path to write a file at the end of a run; its directory must exist, it must not
    be a directory, and the file (when it is a regular one) or its directory must take a write, so that a
    typo or a read-only place fails before the run instead of after it. A device (``/dev/full``) is known
    only on writing: the command catches that error."""
    import tempfile

    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no directory {path.parent}")
    try:
        if path.is_file():   # opened for appending, closed at once: its contents stay
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        elif not path.exists():
            # os.access says yes to root even on a read-only mount: write a file to know
            with tempfile.TemporaryFile(dir=path.parent):
                pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({e.strerror or e}); give a writable "
                                         "path") from None
    return path


def target_checkpoint(text: str) -> Path:
    """An argparse type: ``--target``'s path. A ``.gguf`` file (Llama or Qwen2) is converted once into
    safespec's cache (``spec_decode.models.gguf.save_gguf_as_hf_dir``, written as the real model's is, by
    ``disk_cache.convert_once``) and that directory is returned, so that every check, our decoders and
    transformers' methods read one HF-layout checkpoint; anything else is returned as given (checked later)."""
    import hashlib

    from spec_decode.models.gguf import is_gguf_file, save_gguf_as_hf_dir

    path = Path(text)
    if not is_gguf_file(path):
        return path
    from spec_decode.disk_cache import convert_once

    key = hashlib.sha256(os.fspath(path.resolve()).encode()).hexdigest()[:16]   # one entry per file
    try:
        return convert_once(path.resolve(), f"gguf-{path.stem}-{key}", save_gguf_as_hf_dir)
    except (ValueError, OSError, ImportError) as e:   # CheckpointError, a missing file, the cache, no gguf
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None


def drafter_checkpoint(text: str) -> Path:
    """An argparse type: a drafter's checkpoint directory; an existing file (a ``.gguf`` one especially) is
    an error saying what it can be used as (a missing path is not: its methods are skipped)."""
    from spec_decode.models.checkpoint import GGUF_HINT

    path = Path(text)
    if path.is_file():
        hint = GGUF_HINT if path.suffix.lower() == ".gguf" else "give the directory that holds config.json"
        raise argparse.ArgumentTypeError(f"{text} is a file; a drafter loads from a checkpoint directory: {hint}")
    return path


# ---------------------------------------------------------------------- shared options
def add_input_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint and prompt options of ``spec-bench`` and its model-running subcommands (defaults: the
    shipped fixtures). Their contents are checked before any model loads (``run.check_inputs``)."""
    fx = default_fixtures_dir()
    p.add_argument("--target", type=target_checkpoint, default=fx / TARGET_SUBDIR,
                   help="target checkpoint: a HF-layout directory, or a .gguf file (converted once into the cache)")
    p.add_argument("--draft-lm", type=drafter_checkpoint, default=fx / DRAFT_SUBDIR,
                   help="plain draft LM (draft_chain, hf_assisted)")
    p.add_argument("--eagle", type=drafter_checkpoint, default=fx / EAGLE_SUBDIR, help="EAGLE-1/2 head")
    p.add_argument("--eagle3", type=drafter_checkpoint, default=fx / EAGLE3_SUBDIR, help="EAGLE-3 head (optional)")
    p.add_argument("--prompts", type=Path, default=fx / PROMPTS_FILE, help="JSONL with 'token_ids' per line")


def input_paths(args: argparse.Namespace) -> dict:
    """The ``BenchConfig`` fields of the options ``add_input_args`` adds."""
    return {name: getattr(args, name) for name in ("target", "draft_lm", "eagle", "eagle3", "prompts")}


def add_run_args(p: argparse.ArgumentParser, *, num_prompts: int, max_new_tokens: int) -> None:
    """``--num-prompts`` and ``--max-new-tokens`` (integers >= 1; the second is also checked against the
    target's positions before any model loads)."""
    p.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help=f"tokens generated per prompt (default {max_new_tokens}); the longest prompt plus this "
                        "must fit the target's max_position_embeddings")


def add_threads_arg(p: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--threads``: at most the machine's CPUs (more only oversubscribe them, and a thousand threads
    exhaust the memory of the loaders' own thread pools)."""
    shown = "torch's" if default is None else default
    cpus = os.cpu_count() or 1
    p.add_argument("--threads", type=at_most(positive_int, cpus, " (this machine's CPUs)"), default=default,
                   help=f"torch intra-op threads, 1 to {cpus} (default: {shown}); use 1 on a busy machine")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device, default="auto", help=f"{DEVICES} (default auto: cuda when available)")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--dtype``: one of ``config.BENCH_DTYPES`` (argparse's ``choices``: an empty or unknown name is an error)."""
    p.add_argument("--dtype", default=None, choices=BENCH_DTYPES,
                   help=f"{', '.join(BENCH_DTYPES)} (default: fp32 on CPU, bf16 on CUDA)")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="torch.compile our models (ar included), compiled during the warm-up calls")


BENCH_EXTRA_MODULES = ("tqdm", "matplotlib", "safetensors")
"""What every ``spec-bench`` run imports beyond the library (progress bars, plots, checkpoints):
the ``[bench]`` extra. Hugging Face methods also need transformers, checked when they are chosen."""


def missing_bench_extra(modules=BENCH_EXTRA_MODULES) -> str | None:
    """A one-line message naming the ``[bench]`` extra when one of ``modules`` is not installed, else None."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"spec-bench: error: {', '.join(missing)} not installed: spec-bench needs the bench extra "
            '(pip install "safespec[bench]")')


# ---------------------------------------------------------------------- the anchor (llama.cpp)
LLAMA_CPP_MODULE = "llama_cpp"
ANCHOR_INSTALL = "pip install '.[anchor]' (or pip install llama-cpp-python)"
ANCHOR_SKIPPED = f"anchor ({','.join(ANCHOR_METHODS)}) skipped: llama-cpp-python is not installed; {ANCHOR_INSTALL}"
"""The one line a suite's results carry when the anchor's package is absent."""


def llama_cpp_installed() -> bool:
    """Whether ``llama_cpp`` can be imported (found without importing it: it loads a shared library)."""
    try:
        return importlib.util.find_spec(LLAMA_CPP_MODULE) is not None
    except ValueError:   # in sys.modules without a __spec__ (a stand-in module)
        return sys.modules.get(LLAMA_CPP_MODULE) is not None


def check_anchor_installed(methods) -> None:
    """BenchInputError naming ``--methods`` and the package when ``methods`` asks for an anchor method and
    ``llama-cpp-python`` is not installed."""
    asked = [k for k in methods if k in ANCHOR_METHODS]
    if asked and not llama_cpp_installed():
        raise BenchInputError(f"--methods: {','.join(asked)} need llama-cpp-python, which is not installed: "
                              f"{ANCHOR_INSTALL}")


def target_gguf(target) -> Path | None:
    """The GGUF file the checkpoint directory ``target`` was converted from (its cache marker's source),
    or None for a checkpoint that was not (any other directory)."""
    from spec_decode.disk_cache import entry_source
    from spec_decode.models.gguf import is_gguf_file

    source = entry_source(Path(target))
    return source if source is not None and is_gguf_file(source) else None
