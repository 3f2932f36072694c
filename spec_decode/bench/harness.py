"""The bench's shared harness: every method on the same prompts, interleaved, plus the NaN-policy cost.

``spec-bench`` (no subcommand) runs it; ``side_by_side``, ``suites``, ``tune`` and ``profile`` reuse its pieces.

Measurement protocol (why each choice):

* All models load first and stay loaded; then, for each temperature, every method gets one warm-up
  call on a prompt outside the measured set (after the first round of warm-ups, one more such call
  per method measures its peak memory), and the measured calls
  run **interleaved**: batch b of every method, then batch b+1, with the method order rotated per
  batch. On a shared machine absolute speed drifts; interleaving makes the drift hit every method
  alike, so the ratios stay honest.
* ``tokens_per_s`` = generated tokens / summed wall time of the measured ``generate`` calls
  (prefill included). Every method generates exactly ``max_new_tokens`` tokens per prompt: EOS is
  ignored (``generate(ignore_eos=True)``; HF with ``eos_token_id=None``), so that tokens/s compares equal work.
* NaN-policy cost: EAGLE-tree decoders with policy off / sanitize / abort / guard share one target
  and head and run each prompt batch back to back, in rotated order; the overhead is the median paired
  step-time difference over the median ``off`` step (``nan_policy_stage``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from spec_decode.bench.config import (DRAFTER_OPTIONS, METHOD_SPECS, NAN_MODES, BenchConfig, BenchInputError,
                                      check_checkpoint_dir, check_out_dir, check_room, fit_seed, load_prompts)
from spec_decode.bench.machine import MB, PeakMemory, machine_info, sync
from spec_decode.bench.methods import DRAFTER_METHODS, ModelCache, checked_load

CONTRACT_KEYS = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf_generate", "mean_accepted_length",
                 "p50_step_ms", "p90_step_ms", "peak_mem_mb", "greedy_equals_ar")


def temp_key(t: float) -> str:
    """JSON key of a temperature: ``0.0 -> "0"``, ``1.0 -> "1"``, ``0.7 -> "0.7"``."""
    return format(t, "g")


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark described by ``cfg``; write ``results.json`` and ``results.png``; return the results.

    Bad input raises BenchInputError naming the option before anything is measured (``check_inputs``).
    ``results.json`` is rewritten after every stage; when a later stage fails, it keeps what the
    earlier ones measured plus ``"error"`` (the exception's type and message), and the error propagates.
    """
    from tqdm.auto import tqdm

    out = check_out_dir(cfg.out, outputs=("results.json", "results.png"))
    device = torch.device(cfg.device)
    keys = cfg.resolve_methods()
    if not keys:
        why = "; ".join(f"{k}: {r}" for k, r in cfg.skipped.items())
        raise BenchInputError(f"--methods: every requested method was skipped ({why})")
    check_inputs(cfg, keys)
    results = {"machine": machine_info(device), "config": _config_json(cfg, keys)}
    total = len(cfg.dtypes) * _work_units(cfg, keys)
    try:
        with tqdm(total=total, desc="spec-bench", unit="call", disable=not cfg.progress) as bar:
            for i, dname in enumerate(cfg.dtypes):
                part = results if i == 0 else results.setdefault("by_dtype", {}).setdefault(dname, {})
                run_one_dtype(cfg, keys, dname, device, Sink(results, part, out, bar))
    except BaseException as e:   # KeyboardInterrupt too: keep what was measured
        results["error"] = {"type": type(e).__name__, "message": str(e)}
        write_results(results, out)
        raise
    write_results(results, out)
    from spec_decode.bench.report import plot_results

    plot_results(results, out / "results.png")
    return results


@dataclass
class Sink:
    """Where one dtype's numbers go: ``part`` (inside ``results``), saved to ``out`` by ``save()``."""

    results: dict
    part: dict
    out: Path
    bar: object   # a tqdm bar: ``update(n)``

    def save(self) -> None:
        write_results(self.results, self.out)


def write_results(results: dict, out: Path, name: str = "results.json") -> None:
    """Write ``out/name`` (NaN/Inf as null), replacing the file only once the new one is complete."""
    tmp = out / (name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_finite(results), f, indent=2)
    tmp.replace(out / name)


def check_inputs(cfg: BenchConfig, keys, first: int = 0) -> int:
    """Check every input the run will read before anything runs; return the target's vocabulary size.

    The checkpoints of the target and of every drafter the methods and the NaN stage need
    (``check_models``); then the prompts from the ``first``-th on, the measured ones and the warm-up
    prompt after them (``load_prompts``), whose longest plus ``max_new_tokens`` must fit the target's
    positions (``check_room``). Raises BenchInputError naming the option at fault.
    """
    drafters = {METHOD_SPECS[k].drafter for k in keys} | ({"eagle"} if _nan_stage_runs(cfg) else set())
    config = check_models(cfg.target, {name: cfg.drafter_path(name) for name in sorted(drafters - {None})})
    if any(METHOD_SPECS[k].engine == "llama_cpp" for k in keys) and not Path(cfg.gguf).is_file():
        raise BenchInputError(f"--target: llama.cpp's methods run the target's GGUF file, {cfg.gguf}: no such file")
    prompts = load_prompts(Path(cfg.prompts), cfg.num_prompts, config.vocab_size, first=first)
    check_room(cfg.max_new_tokens, config.max_position_embeddings, prompts)
    return config.vocab_size


def check_models(target, drafters: dict):
    """Read the config and the weight files' headers of checkpoint ``target`` and of each drafter
    (``{"eagle": path, ...}``, names as ``MethodSpec.drafter``), without loading weights; return the target's
    ``ModelConfig``.

    A truncated safetensors file fails at its header (``read_key_names``); each drafter's layout must
    match its option (``drafter_layout``). Raises BenchInputError naming the option at fault.
    """
    from spec_decode.models.checkpoint import read_key_names
    from spec_decode.models.eagle import drafter_layout
    from spec_decode.models import ModelConfig

    def check(option: str, path, read_keys=read_key_names):
        check_checkpoint_dir(option, path)   # a missing default names $SAFESPEC_FIXTURES_DIR, not a download
        # a drafter's config names its head class in architectures: only the target's is checked there
        config = checked_load(option, path, lambda: ModelConfig.from_pretrained(path, drafter=option != "--target"))
        return config, checked_load(option, path, lambda: read_keys(path))

    config = check("--target", target)[0]
    for name, path in drafters.items():
        option = DRAFTER_OPTIONS[name]
        head_config, layout = check(option, path, drafter_layout)
        if layout != DRAFTER_METHODS[name]:
            raise BenchInputError(f"{option} {path}: holds a {layout!r} drafter, {option} takes a "
                                  f"{DRAFTER_METHODS[name]!r} one")
        if layout != "draft_model" and head_config.hidden_size != config.hidden_size:   # an EAGLE head reads them
            raise BenchInputError(f"{option} {path}: a head of hidden size {head_config.hidden_size} for a target "
                                  f"of hidden size {config.hidden_size}; give the head trained for --target {target}")
    return config


def _work_units(cfg: BenchConfig, keys) -> int:
    num_batches = math.ceil(cfg.num_prompts / cfg.batch_size)
    main = len(cfg.temperatures) * len(keys) * (1 + num_batches) + len(keys)   # + the memory pass
    nan = (len(NAN_MODES) * (1 + cfg.nan_rounds * num_batches)) if _nan_stage_runs(cfg) else 0
    return main + nan


def _nan_stage_runs(cfg: BenchConfig) -> bool:
    return cfg.nan_rounds > 0 and cfg.eagle is not None and Path(cfg.eagle).is_dir()


def _config_json(cfg: BenchConfig, keys) -> dict:
    d = cfg.to_json()
    d["methods_run"] = list(keys)
    d["skipped"] = dict(cfg.skipped)
    d["method_configs"] = {k: METHOD_SPECS[k].describe() for k in cfg.methods}
    d["headline_dtype"] = cfg.dtypes[0]
    d["hf_batch_size"] = 1
    d["ignore_eos"] = True
    d["notes"] = [
        f"batch_size={cfg.batch_size} prompts per generate call for our methods (1 = latency setting); "
        "HF and llama.cpp methods always run one prompt per call (assisted generation supports batch 1 only).",
        "EOS stopping is disabled for every method (ignore_eos): each prompt gets exactly max_new_tokens tokens.",
        "tokens_per_s = generated tokens / summed wall time of generate calls (prefill included), "
        "after one warm-up call per method and temperature on a prompt outside the measured set.",
        "p50/p90_step_ms: per verify step for our methods; for HF methods, each call's time per "
        "generated token (HF exposes no per-step timing).",
        "peak_mem_mb = weights of the models the method uses + the peak memory increase during one "
        "extra call after all warm-ups (CPU: sampled RSS, approximate; CUDA: max_memory_allocated).",
        "nan_policy_overhead_pct: EAGLE tree (5/4/8), greedy; median of paired step-time differences "
        "(mode minus off, same prompt, same step) over the median off step, in percent.",
    ]
    if any(METHOD_SPECS[k].engine == "llama_cpp" for k in cfg.methods):
        d["notes"].append("llama_cpp methods: llama.cpp on the target's GGUF file (its quantized weights, its "
                          "kernels and sampler), the anchor column; not exact-equivalent to ar.")
    return d


def run_one_dtype(cfg: BenchConfig, keys, dtype_name: str, device: torch.device, sink: Sink) -> None:
    """All methods at every temperature in one dtype, then the NaN-policy stage, into ``sink.part``.

    ``sink.save()`` runs after each stage, so that a failing later stage loses nothing measured.
    ``config.method_configs`` gets each decoder's settings as it reads them (``num_steps``, ``draft_sampling``),
    and a method under ``lookup_tokens="auto"`` its measured verify costs (``methods[key]["lookup_costs"]``).
    """
    part, bar = sink.part, sink.bar
    models = ModelCache(cfg, dtype_name, device)
    vocab = models.get("target").config.vocab_size
    prompts = load_prompts(Path(cfg.prompts), cfg.num_prompts, vocab)
    measured = prompts[:cfg.num_prompts]
    warm = prompts[cfg.num_prompts] if len(prompts) > cfg.num_prompts else prompts[0]
    batches = [measured[i:i + cfg.batch_size] for i in range(0, len(measured), cfg.batch_size)]
    runners = {k: models.runner(METHOD_SPECS[k]) for k in keys}
    sink.results["config"]["method_configs"].update({k: runners[k].describe() for k in keys})
    weights = {k: runners[k].weight_bytes() for k in keys}

    # HF's and llama.cpp's runners take one prompt per call
    warm_batch = {k: [warm] if METHOD_SPECS[k].engine != "ours" else [warm] * cfg.batch_size for k in keys}
    warm_seed = fit_seed(cfg.seed, cfg.batch_size)
    by_temp: dict[str, dict] = {}
    runtime_mem: dict[str, int] = {}
    for temp in cfg.temperatures:
        for k in keys:   # warm-up
            runners[k].generate(warm_batch[k], cfg.max_new_tokens, temp, warm_seed)
            bar.update(1)
        if not runtime_mem:
            # Measured after every method's warm-up, so that one-time process costs (thread pools,
            # first allocations) do not land on whichever method runs first.
            for k in keys:
                with PeakMemory(device) as mem:
                    runners[k].generate(warm_batch[k], cfg.max_new_tokens, temp, warm_seed)
                runtime_mem[k] = mem.peak_increase
                bar.update(1)
        calls = measure_interleaved(runners, batches, cfg.max_new_tokens, temp, cfg.seed, bar)
        by_temp[temp_key(temp)] = _summarize(keys, calls, temp, weights, runtime_mem)

    part.update({"dtype": dtype_name, "methods": _assemble(cfg, keys, by_temp)})
    for k in keys:   # lookup_tokens="auto": the costs measured at its first call, which its choices read
        costs = runners[k].lookup_costs()
        if costs is not None:
            part["methods"][k]["lookup_costs"] = costs
    sink.save()
    part.update(nan_policy_stage(cfg, models, batches, device, bar) if _nan_stage_runs(cfg)
                else {"nan_policy_overhead_pct": {m: None for m in NAN_MODES if m != "off"},
                      "nan_policy": {"skipped": "no EAGLE head or --nan-rounds 0"}})
    sink.save()


def _rotate(seq, n: int):
    n %= len(seq)
    return tuple(seq[n:]) + tuple(seq[:n])


def percentile(values, q: float) -> float | None:
    """Linear-interpolated ``q``-quantile (0..1) of ``values``; None when empty."""
    if not values:
        return None
    return torch.tensor(values, dtype=torch.float64).quantile(q).item()


def measure_interleaved(runners: dict, batches, max_new_tokens: int, temperature: float, seed: int,
                        bar=None) -> dict:
    """One ``generate`` call per runner and prompt batch, interleaved: batch b of every runner, then
    batch b + 1, the runner order rotated per batch (the module docstring says why).

    Batch b is seeded ``seed * 100003 + b`` for every runner (``fit_seed``: folded into the library's seed
    range). Returns runner key -> list of CallResult.
    """
    calls = {k: [] for k in runners}
    for b, batch in enumerate(batches):
        for k in _rotate(tuple(runners), b):
            calls[k].append(runners[k].generate(batch, max_new_tokens, temperature,
                                                fit_seed(seed * 100003 + b, len(batch))))
            if bar is not None:
                bar.update(1)
    return calls


def summarize_calls(calls) -> dict:
    """Speed and acceptance of one runner's measured calls (a list of CallResult).

    ``tokens_per_s`` = generated tokens / summed call seconds; ``mean_accepted_length`` over all
    verify steps (None for non-speculative runners); step percentiles in ms.
    """
    n_tok = sum(len(t) for c in calls for t in c.tokens)
    secs = sum(c.seconds for c in calls)
    accepted = [a for c in calls for a in c.accepted_lengths]
    steps = [s for c in calls for s in c.step_s]
    p50, p90 = percentile(steps, 0.5), percentile(steps, 0.9)
    return {
        "tokens_per_s": n_tok / secs if secs > 0 else None,
        "mean_accepted_length": sum(accepted) / len(accepted) if accepted else None,
        "p50_step_ms": None if p50 is None else p50 * 1e3,
        "p90_step_ms": None if p90 is None else p90 * 1e3,
        "generated_tokens": n_tok,
        "wall_s": secs,
        "num_verify_steps": len(accepted) if accepted else None,
        "accepted_length_hist": _hist(accepted),
    }


def _summarize(keys, calls, temp: float, weights, runtime_mem) -> dict:
    """Per-method numbers at one temperature (speedups filled in by ``add_speedups``)."""
    stats = {}
    ar_tokens = [t for c in calls["ar"] for t in c.tokens] if "ar" in calls else None
    for k in keys:
        tokens = [t for c in calls[k] for t in c.tokens]
        equal = None
        mismatched = None
        if temp == 0 and ar_tokens is not None:
            mismatched = sum(a != b for a, b in zip(tokens, ar_tokens))
            equal = mismatched == 0
        speed = summarize_calls(calls[k])
        stats[k] = {
            "tokens_per_s": speed["tokens_per_s"],
            "speedup_vs_ar": None,
            "speedup_vs_hf_generate": None,
            "mean_accepted_length": speed["mean_accepted_length"],
            "p50_step_ms": speed["p50_step_ms"],
            "p90_step_ms": speed["p90_step_ms"],
            "peak_mem_mb": (weights[k] + runtime_mem.get(k, 0)) / MB,
            "greedy_equals_ar": equal,
            "greedy_mismatched_prompts": mismatched,
            **{n: speed[n] for n in ("generated_tokens", "wall_s", "num_verify_steps", "accepted_length_hist")},
            "weights_mb": weights[k] / MB,
            "runtime_mem_mb": runtime_mem.get(k, 0) / MB,
        }
    add_speedups(stats)
    return stats


def _hist(values) -> dict[str, int] | None:
    """``{"1": count, "2": count, ...}`` up to the largest value; None when empty."""
    if not values:
        return None
    return {str(n): values.count(n) for n in range(1, max(values) + 1)}


def add_speedups(stats: dict) -> None:
    """Fill ``speedup_vs_ar`` / ``speedup_vs_hf_generate`` of every entry of ``stats`` (key -> numbers)
    from the tokens/s of the ``ar`` / ``hf_generate`` entries, where those ran."""
    for ref, name in (("ar", "speedup_vs_ar"), ("hf_generate", "speedup_vs_hf_generate")):
        base = stats.get(ref, {}).get("tokens_per_s")
        for s in stats.values():
            if base and s["tokens_per_s"] is not None:
                s[name] = s["tokens_per_s"] / base


def _assemble(cfg: BenchConfig, keys, by_temp: dict) -> dict:
    """One entry per requested method: the greedy (or first) temperature's numbers on top, all under
    ``by_temperature``; a skipped method gets null numbers and ``skipped``."""
    head = temp_key(0.0) if 0.0 in cfg.temperatures else temp_key(cfg.temperatures[0])
    methods = {}
    for k in cfg.methods:
        if k not in keys:
            methods[k] = {**{c: None for c in CONTRACT_KEYS}, "skipped": cfg.skipped.get(k, "not run")}
            continue
        entry = dict(by_temp[head][k])
        entry["headline_temperature"] = float(head)
        entry["by_temperature"] = {t: by_temp[t][k] for t in by_temp}
        methods[k] = entry
    return methods


# ---------------------------------------------------------------------- NaN policy cost
def nan_policy_stage(cfg: BenchConfig, models: ModelCache, batches, device: torch.device, bar) -> dict:
    """EAGLE tree step time with nan_policy off / sanitize / abort / guard (``NAN_MODES``): the cost of NaN safety.

    Every (round, batch) runs the modes back to back in rotated order. Greedy decoding of
    NaN-free logits takes the same path in every mode, so step ``i`` of a mode and step ``i`` of
    ``off`` do the same work but for the NaN pass: the headline overhead is the median of these
    paired step differences over the median ``off`` step, in percent, which a burst of load from
    another process moves far less than a ratio of total times (also reported).
    Also times the numerics pass alone at the verify shape ``[batch_size * 8, V]``. On CUDA the
    pipeline's pass is checked for host syncs.
    """
    spec = METHOD_SPECS["eagle_tree"]
    runners = {m: models.runner(spec, nan_policy=m) for m in NAN_MODES}
    for m in NAN_MODES:   # warm-up
        runners[m].generate(batches[0], cfg.max_new_tokens, 0.0, cfg.seed)
        bar.update(1)
    steps = {m: [] for m in NAN_MODES}
    diffs = {m: [] for m in NAN_MODES if m != "off"}
    wall = {m: 0.0 for m in NAN_MODES}
    tokens = {m: 0 for m in NAN_MODES}
    for r in range(cfg.nan_rounds):
        for b, batch in enumerate(batches):
            calls = {}
            for m in _rotate(NAN_MODES, r + b):
                calls[m] = c = runners[m].generate(batch, cfg.max_new_tokens, 0.0, cfg.seed)
                steps[m].extend(c.step_s)
                wall[m] += c.seconds
                tokens[m] += sum(len(t) for t in c.tokens)
                bar.update(1)
            for m in diffs:
                diffs[m].extend(a - o for a, o in zip(calls[m].step_s, calls["off"].step_s))
    off_median = percentile(steps["off"], 0.5)
    overhead = {m: percentile(diffs[m], 0.5) / off_median * 100 for m in diffs}
    total = {m: sum(steps[m]) for m in NAN_MODES}
    detail = {
        "method": "eagle_tree", "config": spec.describe(), "rounds": cfg.nan_rounds,
        "estimator": "median paired step-time difference / median off step * 100",
        "tokens_per_s": {m: tokens[m] / wall[m] for m in NAN_MODES},
        "p50_step_ms": {m: percentile(steps[m], 0.5) * 1e3 for m in NAN_MODES},
        "step_time_total_s": total,
        "total_time_overhead_pct": {m: (total[m] - total["off"]) / total["off"] * 100 for m in diffs},
    }
    target = models.get("target")
    rows = cfg.batch_size * spec.num_draft_tokens
    pass_ms = time_nan_pass(rows, spec.num_draft_tokens, target.config.vocab_size, target.dtype, device)
    detail["nan_pass_ms"] = pass_ms
    detail["nan_pass_pct_of_p50_step"] = pass_ms / detail["p50_step_ms"]["off"] * 100
    if device.type == "cuda":
        detail["nan_pass_host_syncs"] = assert_sync_free_nan_pass(runners["sanitize"].decoder, batches[0],
                                                                  cfg.max_new_tokens)
    return {"nan_policy_overhead_pct": overhead, "nan_policy": detail}


def time_nan_pass(rows: int, rows_per_request: int, vocab: int, dtype: torch.dtype, device: torch.device,
                  min_run_time: float = 0.1) -> float:
    """Median ms of ``nan_counts_per_request(sanitize=True)`` on clean ``[rows, vocab]`` logits."""
    from torch.utils import benchmark

    from numerics import nan_counts_per_request

    x = torch.randn(rows, vocab, device=device).to(dtype)
    cu = torch.arange(0, rows + 1, rows_per_request, device=device, dtype=torch.int32)
    timer = benchmark.Timer(stmt="f(x, cu, sanitize=True)", globals={"f": nan_counts_per_request, "x": x, "cu": cu},
                            num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def assert_sync_free_nan_pass(decoder, prompts, max_new_tokens: int) -> int:
    """Run one ``generate`` with the decoder's NaN pass under ``set_sync_debug_mode("error")``.

    The checked pass replaces ``decoder.hooks.nan_pass`` for this one call, so only this decoder's
    numerics stage is checked; any host sync inside it raises. Returns the number of checked passes'
    syncs (always 0 when it returns).
    """
    hooks = decoder.hooks

    def checked(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return hooks.nan_pass(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    decoder.hooks = replace(hooks, nan_pass=checked)
    try:
        decoder.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
    finally:
        decoder.hooks = hooks
    sync(decoder.target.device)
    return 0


def _finite(obj):
    """JSON has no NaN/Inf: map them to None (e.g. a speedup over a zero-time baseline)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
