"""fixtures/make_fixtures.py, the script that trains the shipped tiny models, and fixtures/measure_fixtures.py.

The hold-out split (the shipped prompts come from held-out files), EAGLE-3 training-time test against
sequential drafting, resumable training, recipe checks, and the goal table. The data they built is tested
in test_fixtures.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from spec_decode.models.eagle import Eagle3Head
from spec_decode.models import Transformer

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "make_fixtures.py"


def _script_module(path: Path):
    """A script of fixtures/ as a module; its siblings (``fixtures_*.py``) import by name, as when it runs, so
    fixtures/ goes on ``sys.path`` as the script's own directory does then."""
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_fixtures():
    """The build script of this checkout as a module (it has no import-time side effects)."""
    return _script_module(BUILD_SCRIPT)


@pytest.fixture
def measure():
    """fixtures/measure_fixtures.py as a module (imports nothing heavy at import time)."""
    return _script_module(BUILD_SCRIPT.parent / "measure_fixtures.py")


# ------------------------------------------------------------------ the hold-out split, the EAGLE-3 unroll
def test_prompts_are_held_out_and_tokenized(safespec_tiny_prompts, safespec_tiny_target_path, manifest, make_fixtures):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(safespec_tiny_target_path)
    assert len(safespec_tiny_prompts) >= 64
    assert len({p["id"] for p in safespec_tiny_prompts}) == len(safespec_tiny_prompts)
    held_out = set(manifest["corpus"]["held_out_files"])
    for p in safespec_tiny_prompts:
        assert tok(p["text"])["input_ids"] == p["token_ids"], p["id"]
        assert 32 <= len(p["token_ids"]) <= 96, p["id"]
        assert p["source_file"] in held_out, p["id"]
        assert make_fixtures.is_held_out(p["source_file"]), p["id"]


def test_holdout_rule_splits_whole_files(make_fixtures, manifest):
    held = manifest["corpus"]["held_out_files"]
    assert held and all(make_fixtures.is_held_out(f) for f in held)
    # the rule is a hash of the path: deterministic, and about HOLDOUT_PERCENT of files
    names = [f"pkg/mod{i}.py" for i in range(2000)]
    frac = sum(map(make_fixtures.is_held_out, names)) / len(names)
    assert 0.01 < frac < 0.06


def test_eagle3_training_time_test_matches_sequential_drafting(make_fixtures, shipped_target, safespec_tiny_eagle3_path):
    """The build's unrolled EAGLE-3 training-time test equals drafting step by step through the KV cache.

    Node (s, t) of the unroll must see exactly what draft step s from root t sees at inference: the
    committed step-1 rows 0..t and its own earlier steps.
    """
    head = Eagle3Head.from_pretrained(safespec_tiny_eagle3_path, shipped_target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    T, K = 12, 3
    ids = torch.randint(0, shipped_target.config.vocab_size, (1, T), generator=gen)
    fused = torch.randn(1, T, shipped_target.config.hidden_size, generator=gen)
    with torch.no_grad():
        unrolled = make_fixtures.eagle3_unrolled(head, ids, fused, K)
        for t in (0, 4, T - K - 1):
            cache = head.new_cache(1, T + K)
            out = head(ids[:, 1: t + 2], fused[:, : t + 1], cache)
            cache.commit(torch.tensor([t + 1]))
            steps = [out.logits[:, t]]
            feat = out.hidden[:, t:t + 1]
            for s in range(1, K):
                out = head(ids[:, t + s + 1: t + s + 2], feat, cache, position_ids=torch.tensor([[t + s]]))
                cache.commit(torch.tensor([1]))
                steps.append(out.logits[:, 0])
                feat = out.hidden
            for s in range(K):
                torch.testing.assert_close(unrolled[s][:, t], steps[s], atol=1e-4, rtol=1e-4)


def _recomputed_unroll(head, ids, fused, num_steps):
    """The training-time test as the build first ran it: step s recomputes steps 1..s in one block."""
    B, T = ids.shape
    n = T - num_steps
    t_idx = torch.arange(n)
    outs, feeds = [], [fused[:, :n]]
    for s in range(1, num_steps + 1):
        toks = torch.cat([ids[:, j: j + n] for j in range(1, s + 1)], dim=1)
        pos = torch.cat([t_idx + j for j in range(s)])[None].expand(B, -1)
        step_of, row_of = torch.arange(s).repeat_interleave(n), t_idx.repeat(s)
        mask = ((step_of[None, :] == 0) & (row_of[None, :] <= row_of[:, None])) | (
            (row_of[None, :] == row_of[:, None]) & (step_of[None, :] <= step_of[:, None]))
        out = head(toks, torch.cat(feeds, dim=1), head.new_cache(B, s * n), position_ids=pos,
                   tree_mask=mask[None].expand(B, -1, -1))
        outs.append(out.logits[:, (s - 1) * n:])
        feeds.append(out.hidden[:, (s - 1) * n:])
    return outs


def test_eagle3_unroll_gives_the_recomputed_losses_and_gradients(make_fixtures, shipped_target, safespec_tiny_eagle3_path):
    """Appending each step to a cache (one block of n rows per step) trains exactly what recomputing every
    earlier step did (1 + 2 + ... + K blocks): same logits, same gradients, through the fed-back features
    and the cached K/V alike."""
    head = Eagle3Head.from_pretrained(safespec_tiny_eagle3_path, shipped_target, dtype=torch.float64).train()
    gen = torch.Generator().manual_seed(1)
    T, K = 11, 3
    ids = torch.randint(0, shipped_target.config.vocab_size, (2, T), generator=gen)
    fused = torch.randn(2, T, shipped_target.config.hidden_size, generator=gen, dtype=torch.float64)
    weights = [torch.randn(2, T - K, head.draft_vocab_size, generator=gen, dtype=torch.float64) for _ in range(K)]
    grads = []
    for unroll in (make_fixtures.eagle3_unrolled, _recomputed_unroll):
        head.zero_grad(set_to_none=True)
        outs = unroll(head, ids, fused, K)
        sum((o * w).sum() for o, w in zip(outs, weights)).backward()
        grads.append({name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None})
        grads[-1]["logits"] = torch.cat([o.detach() for o in outs], 1)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name in grads[0]:
        # float64, but the RMSNorms compute in float32: gradients summed in another order differ at ~1e-8
        scale = grads[1][name].abs().max().item()
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6 * scale, rtol=0, msg=name)


# ------------------------------------------------------------------ the build: resumable training, the goal table


class StopAfter:
    """A stand-in for fixtures_run.CLOCK: ``must_stop`` turns true at its n-th call."""

    def __init__(self, n):
        self.calls, self.n = 0, n

    def must_stop(self):
        self.calls += 1
        return self.calls >= self.n


def test_interrupted_training_resumes_to_the_same_weights(make_fixtures, tmp_path, monkeypatch):
    """Stopping mid-run and rerunning replays the uninterrupted run bit for bit (schedule, data, optimizer)."""
    model = lambda: torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    cfg = dict(steps=7, lr=1e-2, warmup=2, eval_every=3)

    def run(stage, stop_after):
        torch.manual_seed(0)
        net = model()
        opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"])
        gen = torch.Generator().manual_seed(1)

        def step_fn(step):
            x = torch.randint(0, 50, (4, 5), generator=gen)
            loss = torch.nn.functional.cross_entropy(net(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            return {"loss": loss.detach()}

        monkeypatch.setattr(make_fixtures.fixtures_run, "CLOCK", StopAfter(stop_after))
        state = make_fixtures.train_resumable(stage, net, opt, gen, cfg, step_fn,
                                              eval_fn=lambda: {"w": round(float(net[1].weight.detach().sum()), 6)})
        return net, state

    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_DIR", tmp_path)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_EVERY_S", 1e9)
    whole, whole_state = run("whole", 10**9)
    with pytest.raises(make_fixtures.Interrupted):
        run("split", 4)
    assert (tmp_path / "split.pt").exists()
    resumed, state = run("split", 10**9)
    assert state["runs"] == 2 and state["step"] == 7
    assert state["hist"]["loss"] == whole_state["hist"]["loss"]
    assert state["eval"] == whole_state["eval"]
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def linear_step_fn(net, opt, gen):
    """A training step of ``net`` (a Linear of 3 inputs) on random inputs from ``gen``: ``step_fn`` for
    ``train_resumable``."""
    def step_fn(step):
        loss = net(torch.randn(4, 3, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return {"loss": loss.detach()}
    return step_fn


def test_stalled_compares_the_last_evaluations_with_the_best_before_them(make_fixtures):
    stalled = make_fixtures.fixtures_run.stalled
    evals = lambda *xs: [{"a": x} for x in xs]   # noqa: E731
    assert not stalled(evals(0.5, 0.6), "a", patience=2, min_gain=0.01)          # too few to judge
    assert not stalled(evals(0.5, 0.50, 0.52), "a", patience=2, min_gain=0.01)   # the last one gained enough
    assert stalled(evals(0.5, 0.505, 0.509), "a", patience=2, min_gain=0.01)
    assert stalled(evals(0.6, 0.5, 0.55), "a", patience=2, min_gain=0.0)          # below an earlier best
    assert not stalled(evals(0.5, 0.4, 0.45, 0.6), "a", patience=2, min_gain=0.05)


def test_a_run_may_stop_early_only_once_its_learning_rate_is_half_its_peak(make_fixtures):
    may_stop_early = make_fixtures.fixtures_run.may_stop_early
    cfg = dict(steps=1000, lr=1e-3, warmup=50)
    # the cosine from the peak to a tenth of it crosses half the peak at 53.5% of the schedule
    assert not any(may_stop_early(cfg, step) for step in (0, 49, 200, 500, 530))
    assert all(may_stop_early(cfg, step) for step in (540, 600, 1000))


def test_a_stalled_run_stops_early_and_stays_stopped(make_fixtures, tmp_path, monkeypatch):
    """With a stop key the run ends once its eval value stalls, from the second half of its schedule on
    (a stall at the peak learning rate does not stop it); a rerun keeps the stop instead of training on."""
    cfg = dict(steps=50, lr=1e-2, warmup=1, eval_every=5, stop_key="score", stop_patience=2, stop_min_gain=0.1)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(0)
    # gains 0.05 and 0.08 after 0.5: stalled from step 20, where the learning rate is still above half its
    # peak; the first evaluation at or below it (step 30) stops the run
    scores = iter([0.1, 0.5, 0.55, 0.58, 0.59, 0.595] + [0.9] * 20)

    step_fn = linear_step_fn(net, opt, gen)

    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_DIR", tmp_path)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CLOCK", StopAfter(10**9))
    state = make_fixtures.train_resumable("s", net, opt, gen, cfg, step_fn, eval_fn=lambda: {"score": next(scores)})
    assert state["step"] == 30 and state["stopped_early"] == 30
    assert [e["step"] for e in state["eval"]] == [5, 10, 15, 20, 25, 30]
    again = make_fixtures.train_resumable("s", net, opt, gen, cfg, step_fn, eval_fn=lambda: {"score": next(scores)})
    assert again["step"] == 30 and again["runs"] == 2


def test_a_checkpoint_of_another_recipe_is_not_resumed(make_fixtures, tmp_path, monkeypatch):
    """A stage's checkpoint records its recipe; a run with another recipe refuses it, naming what changed,
    instead of silently continuing the old training under the new name."""
    cfg = dict(steps=6, lr=1e-2, warmup=1)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg["lr"])
    gen = torch.Generator().manual_seed(0)

    step_fn = linear_step_fn(net, opt, gen)

    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_DIR", tmp_path)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_EVERY_S", 1e9)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CLOCK", StopAfter(3))
    with pytest.raises(make_fixtures.Interrupted):
        make_fixtures.train_resumable("head", net, opt, gen, cfg, step_fn)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CLOCK", StopAfter(10**9))
    with pytest.raises(RuntimeError, match=r"another head recipe \(changed: \['aux_scaling', 'lr'\]\)"):
        make_fixtures.train_resumable("head", net, opt, gen, {**cfg, "lr": 2e-2, "aux_scaling": "rms"}, step_fn)
    assert make_fixtures.train_resumable("head", net, opt, gen, cfg, step_fn)["step"] == 6   # its own recipe resumes


def test_a_misspelt_recipe_option_is_refused(make_fixtures):
    """An EAGLE-3 option with a value the build does not know raises, naming the key, instead of
    silently training without it."""
    make_fixtures.check_recipe_choices("EAGLE3_TRAIN", make_fixtures.EAGLE3_TRAIN, make_fixtures.EAGLE3_CHOICES)
    make_fixtures.check_recipe_choices("EAGLE3_TRAIN", {**make_fixtures.EAGLE3_TRAIN, "aux_scaling": None},
                                       make_fixtures.EAGLE3_CHOICES)
    for key, bad in (("aux_scaling", "RMS"), ("lm_head_init", "targte")):
        with pytest.raises(ValueError, match=rf"EAGLE3_TRAIN\['{key}'\] must be one of .*got '{bad}'"):
            make_fixtures.check_recipe_choices("EAGLE3_TRAIN", {**make_fixtures.EAGLE3_TRAIN, key: bad},
                                               make_fixtures.EAGLE3_CHOICES)
    missing = {k: v for k, v in make_fixtures.EAGLE3_TRAIN.items() if k != "aux_scaling"}
    with pytest.raises(ValueError, match=r"EAGLE3_TRAIN is missing the option 'aux_scaling'"):
        make_fixtures.check_recipe_choices("EAGLE3_TRAIN", missing, make_fixtures.EAGLE3_CHOICES)


def test_eagle3_aux_scaling_folds_into_fc(make_fixtures):
    """Training on each aux channel scaled to unit RMS, then folding the scale into fc, gives the published
    layout's function: fc over the raw states."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(5, 7, 6, generator=g) * torch.tensor([1.0, 2.0, 50.0, 0.5, 3.0, 1.0])
    rms = make_fixtures.channel_rms(feats.half(), chunk=2)
    torch.testing.assert_close(rms, feats.half().float().pow(2).mean((0, 1)).sqrt(), rtol=1e-5, atol=0)
    fc = torch.nn.Linear(6, 4, bias=False)
    x = feats.reshape(-1, 6)
    want = fc(x / rms)
    make_fixtures.fold_input_scale(fc, 1.0 / rms)
    torch.testing.assert_close(fc(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags,want", [("fpu avx2 fma", "fp32"), ("avx2 avx512f avx512_bf16", "bf16"),
                                         ("avx2 amx_tile amx_bf16", "bf16"), ("", "fp32")])
def test_auto_training_precision_follows_the_cpu_flags(make_fixtures, flags, want):
    """Issue #14: bf16 autocast only where the CPU has native bf16; fp32 and bf16 are taken as asked."""
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert make_fixtures.resolve_precision("auto", cpuinfo) == want
    assert make_fixtures.resolve_precision("fp32", cpuinfo) == "fp32"
    assert make_fixtures.resolve_precision("bf16", cpuinfo) == "bf16"
    with pytest.raises(ValueError, match="--train-precision"):
        make_fixtures.resolve_precision("fp16", cpuinfo)


def test_a_resumed_stage_keeps_its_checkpoints_precision(make_fixtures, tmp_path, monkeypatch):
    """A run started in bf16 autocast resumes in bf16 even when the new machine would choose fp32."""
    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_DIR", tmp_path)
    monkeypatch.setattr(make_fixtures.fixtures_run, "CKPT_EVERY_S", 1e9)
    seen = []

    def run(precision, stop_after):
        net = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def step_fn(step):
            with make_fixtures.train_autocast():
                y = net(torch.ones(2, 4))
            seen.append((make_fixtures.fixtures_run.PRECISION, y.dtype))
            loss = y.float().square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return {"loss": loss.detach()}

        monkeypatch.setattr(make_fixtures.fixtures_run, "PRECISION", precision)
        monkeypatch.setattr(make_fixtures.fixtures_run, "CLOCK", StopAfter(stop_after))
        return make_fixtures.train_resumable("p", net, opt, torch.Generator(), dict(steps=4, lr=0.1, warmup=1),
                                             step_fn)

    with pytest.raises(make_fixtures.Interrupted):
        run("bf16", 2)
    state = run("fp32", 10**9)
    assert state["precision"] == "bf16" and state["step"] == 4
    assert seen == [("bf16", torch.bfloat16)] * 4



def test_features_staged_for_other_aux_layers_are_rebuilt(make_fixtures, tmp_path, monkeypatch):
    """Staged features record their aux layers: those of another recipe are rebuilt, not reused (an EAGLE-3
    head trained on them would silently keep the old layers). The recipe's high layer is the last one."""
    class Rebuilding(Exception):
        pass

    def load_target(*args, **kwargs):
        raise Rebuilding

    monkeypatch.setattr(make_fixtures, "WORK_DIR", tmp_path)
    monkeypatch.setattr(make_fixtures, "STATS_DIR", tmp_path / "stats")
    monkeypatch.setattr(make_fixtures, "load_target", load_target)
    (tmp_path / "stats").mkdir()
    (tmp_path / "features.pt").write_bytes(b"")
    wanted = list(make_fixtures.eagle3_aux_layers(make_fixtures.TARGET_CFG["num_hidden_layers"]))
    assert wanted == [1, 5, 11]
    stats = tmp_path / "stats" / "features.json"
    stats.write_text(json.dumps({"aux_layers": wanted}))
    make_fixtures.stage_features(force=False)   # the recipe's layers: kept
    stats.write_text(json.dumps({"aux_layers": [1, 5, 8]}))
    with pytest.raises(Rebuilding):
        make_fixtures.stage_features(force=False)


def test_eagle3_head_starts_from_the_target_output_layer(make_fixtures, tmp_path):
    """After ``init_from_target_head`` an EAGLE-3 head's logits of any residual stream are the target's
    logits of it at the draft ids (the target's lm_head rows and final norm), and nothing else moved."""
    from tiny_models import make_tiny_eagle3, make_tiny_target

    target = Transformer.from_pretrained(make_tiny_target(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        target.norm.weight.uniform_(0.5, 1.5)   # a trained norm, not the ones a head starts with
    head = make_tiny_eagle3(target, draft_vocab_size=61)
    draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    before = {k: v.clone() for k, v in head.state_dict().items()}
    x = torch.randn(2, 5, target.config.hidden_size)
    assert not torch.allclose(head.compute_logits(x), target.compute_logits(target.norm(x))[..., draft_ids])
    make_fixtures.init_from_target_head(head, target, draft_ids)
    torch.testing.assert_close(head.compute_logits(x), target.compute_logits(target.norm(x))[..., draft_ids],
                               rtol=0, atol=0)
    moved = {k for k, v in head.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == {"lm_head.weight", "norm.weight"}


def test_stage_lr_anneals_a_shortened_cosine_to_its_floor(make_fixtures):
    """A stage cut short keeps its cosine up to `anneal_from`, then falls linearly to the cosine's floor."""
    plain = dict(steps=100, lr=1.0, warmup=10)
    cut = dict(plain, steps=70, cosine_steps=100, anneal_from=60)
    cosine = [make_fixtures.cosine_lr(s / 100, s, warmup=10, peak=1.0) for s in range(101)]
    assert [make_fixtures.stage_lr(plain, s) for s in range(100)] == cosine[:100]
    assert [make_fixtures.stage_lr(cut, s) for s in range(61)] == cosine[:61]
    annealed = [make_fixtures.stage_lr(cut, s) for s in range(60, 71)]
    assert all(a > b for a, b in zip(annealed, annealed[1:]))
    assert annealed[-1] == pytest.approx(cosine[100]) == pytest.approx(0.1)
    assert annealed[5] == pytest.approx((cosine[60] + cosine[100]) / 2)


def test_goal_table_marks_each_goal(measure):
    """measure_fixtures: a goal is met exactly when its figure is on the right side of the bar."""
    good = {"shapes": {s: {"eagle": 3.0, "eagle3": 3.1} for s in measure.SHAPES},
            "eagle_step1_greedy_agreement": 0.8, "eagle3_step1_greedy_agreement": 0.85,
            "eagle_step1_sampled_acceptance": 0.81, "eagle3_step1_sampled_acceptance": 0.8,
            "bench_order_t0": {"eagle3_tree": 3.6, "eagle_tree": 3.5, "eagle_chain": 3.4, "draft_chain": 2.4},
            "target_val_loss": 3.1, "distinct_4grams": 0.5}
    good["shapes"]["tree 5/4/8"]["eagle"] = 3.5
    good["shapes"]["tree 5/4/8"]["eagle3"] = 3.6
    assert all(row["met"] for row in measure.goal_rows(good))
    bad = json.loads(json.dumps(good))
    bad["shapes"]["tree 8/8/64"]["eagle3"] = 3.0            # a tie is not "above"
    bad["eagle_step1_greedy_agreement"] = 0.799
    bad["eagle_step1_sampled_acceptance"] = 0.7
    bad["shapes"]["tree 5/4/8"]["eagle"] = 3.49
    bad["target_val_loss"] = 3.11
    bad["bench_order_t0"]["draft_chain"] = 3.41
    assert not any(row["met"] for row in measure.goal_rows(bad))
    assert "| no |" in measure.markdown_table({"goals": measure.goal_rows(bad)})


def test_ordering_goal_measures_the_benchmarks_own_shapes(measure, fixtures_dir, monkeypatch):
    """The spec-bench ordering goal reads spec-bench's method table, score temperature included, so a
    change of a benchmark shape moves the goal's measure with it."""
    from spec_decode.bench import config

    methods = measure.bench_methods()
    assert list(methods) == list(measure.BENCH_ORDER)
    assert methods["eagle3_tree"] == {"method": "eagle3", "drafter": "tiny-eagle3", "shape": [4, 2, 8],
                                      "score_temperature": 0.5}
    assert methods["eagle_chain"] == {"method": "eagle", "drafter": "tiny-eagle", "shape": [4, 1, 5],
                                      "score_temperature": 1.0}
    assert all((fixtures_dir / "models" / m["drafter"]).is_dir() for m in methods.values())
    moved = config.MethodSpec("eagle3_tree", "ours", "eagle3", "eagle3", 6, 3, 16, score_temperature=0.25)
    monkeypatch.setitem(config.METHOD_SPECS, "eagle3_tree", moved)
    assert measure.bench_methods()["eagle3_tree"] == {"method": "eagle3", "drafter": "tiny-eagle3",
                                                      "shape": [6, 3, 16], "score_temperature": 0.25}
