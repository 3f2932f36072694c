"""``spec-bench profile``: the split of one speculative step, in fractions of one autoregressive step.

For one of our methods it reports, per verify step, the time of each phase as a fraction of one
``ar`` step (the same target, dtype and prompts, ``method="none"``): drafting (catch-up included),
the verify forward, the verify walk (NaN pass and ``tree_verify``), bookkeeping, and whatever the
phases leave out; then the cost of one drafter call in ``ar`` steps. Issue #13's bars read off it:
a drafter call <= 0.08 ``ar`` steps, a chain-4 step without its drafting <= 1.3.

It is keyed on public hooks only, so that a refactor cannot silently drop a stage:

* ``SpecDecoder.hooks.timer``: every step enters ``timer(name)`` around each of its phases, with
  names from ``spec_decode.step.PHASES``; here it is a ``PhaseClock``;
* the drafter's ``draft_forward`` (the ``drafting.Drafter`` protocol's forward, the one way the decoder
  runs it) is wrapped to count and time its calls (``CallClock``), from outside, so that a compiled
  drafter stays one graph;
* ``SpecDecoder.last_stats.step_s`` (whole steps) and ``GenerationResult.accepted_lengths``.

The ``ar`` and the speculative decoder run prompt by prompt, interleaved, after one warm-up call each,
so that drift on a shared machine hits both alike. On CUDA every phase boundary synchronizes (the
split is then exact, the step a little slower than in ``spec-bench``). ``--cprofile N`` adds, from a
separate pass, the top ``N`` functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from spec_decode.bench.args import (add_compile_arg, add_device_arg, add_dtype_arg, add_input_args, add_run_args,
                                    add_threads_arg, input_paths, new_file, nonneg_float, nonneg_int, positive_int)
from spec_decode.bench.config import (DEFAULT_MAX_NEW_TOKENS, METHOD_SPECS, BenchConfig, BenchInputError,
                                      check_room, default_dtype_name, load_prompts)
from spec_decode.bench.machine import sync, torch_threads
from spec_decode.verify_cost import time_verify_blocks

UNACCOUNTED = "unaccounted"


class PhaseClock:
    """A step's phase timer (``StepHooks.timer``): ``with clock(name): ...`` adds the block's wall seconds to ``seconds[name]``.

    Time is exclusive: a phase entered inside another pauses the outer one, so phases never count
    twice. ``clock`` is the time source (``time.perf_counter``; tests pass a fake). On CUDA each
    boundary synchronizes ``device`` so that queued kernels land in the phase that launched them.
    """

    def __init__(self, device: torch.device | None = None, clock=time.perf_counter):
        self.device, self.clock = device, clock
        self.seconds: dict[str, float] = {}
        self.entries: dict[str, int] = {}
        self._stack: list[list] = []   # [name, start of the running part]

    @contextmanager
    def __call__(self, name: str):
        now = self._now()
        if self._stack:
            self._pause(self._stack[-1], now)
        self._stack.append([name, now])
        self.entries[name] = self.entries.get(name, 0) + 1
        try:
            yield
        finally:
            now = self._now()
            self._pause(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now

    def _now(self) -> float:
        if self.device is not None:
            sync(self.device)
        return self.clock()

    def _pause(self, frame: list, now: float) -> None:
        name, start = frame
        self.seconds[name] = self.seconds.get(name, 0.0) + (now - start)


class CallClock:
    """Counts and times the calls of one ``drafting.Drafter`` protocol method of a drafter: ``draft_forward``
    (its forward, the default) or ``compute_logits`` (its logits).

    ``attach(drafter)`` shadows the method with a timed wrapper (an instance attribute); ``detach()``
    removes it. Timing from outside the call keeps a compiled forward (``SpecDecoder(compile=True)``)
    whole: module hooks run inside the compiled call and break its graph, which made a compiled
    drafter call look slower than an eager one. ``calls`` and ``seconds`` accumulate while attached;
    ``active`` is True while a timed call runs.

    ``step_id`` (optional) returns a value that changes once per step (the profile passes the count of
    ``drafting`` phase entries): the first call under each new value is that step's catch-up, counted
    apart in ``catch_up_calls`` and ``catch_up_seconds``. It runs right after the target's verify
    forward, over every token the last step emitted (the whole prompt in a request's first step).
    ``outer`` (optional): another ``CallClock``; calls made while it is ``active`` (a forward that
    computes its own logits) are not counted here, so that no time counts twice.
    ``new_request()`` marks the start of a ``generate`` call: its first catch-up, over the whole prompt,
    is also counted in ``prompt_catch_up_calls`` and ``prompt_catch_up_seconds``.
    """

    def __init__(self, device: torch.device | None = None, clock=time.perf_counter, step_id=None, *,
                 method: str = "draft_forward", outer: "CallClock | None" = None):
        self.device, self.clock, self.step_id, self.method, self.outer = device, clock, step_id, method, outer
        self.calls, self.seconds = 0, 0.0
        self.catch_up_calls, self.catch_up_seconds = 0, 0.0
        self.prompt_catch_up_calls, self.prompt_catch_up_seconds = 0, 0.0
        self._prompt_next = False
        self.active = False
        self._drafter = None
        self._last_step = None

    def attach(self, drafter) -> "CallClock":
        inner = getattr(drafter, self.method)

        def timed(*args, **kwargs):
            if self.outer is not None and self.outer.active:
                return inner(*args, **kwargs)
            step = None if self.step_id is None else self.step_id()
            start = self._now()
            self.active = True
            try:
                return inner(*args, **kwargs)
            finally:
                self.active = False
                elapsed = self._now() - start
                self.seconds += elapsed
                self.calls += 1
                if step is not None and step != self._last_step:
                    self._last_step = step
                    self.catch_up_seconds += elapsed
                    self.catch_up_calls += 1
                    if self._prompt_next:
                        self._prompt_next = False
                        self.prompt_catch_up_seconds += elapsed
                        self.prompt_catch_up_calls += 1

        setattr(drafter, self.method, timed)
        self._drafter = drafter
        return self

    def new_request(self) -> None:
        """The next catch-up is a request's first, over its prompt."""
        self._prompt_next = True

    def detach(self) -> None:
        if self._drafter is not None:
            delattr(self._drafter, self.method)   # the class's method shows through again
            self._drafter = None

    def _now(self) -> float:
        if self.device is not None:
            sync(self.device)
        return self.clock()


# What the profile turns off while it runs, so that every step (warm-up included) drafts the configured
# shape with the drafter: no last step trimmed to the tokens left, no step verifying lookup drafts instead.
_OFF_WHILE_PROFILING = {"trim_last_steps": False, "lookup_ngram": 0}


def _switch_off(decoder) -> dict:
    """Set ``decoder``'s ``_OFF_WHILE_PROFILING`` attributes (those it has); return their previous values."""
    saved = {name: getattr(decoder, name) for name in _OFF_WHILE_PROFILING if hasattr(decoder, name)}
    for name in saved:
        setattr(decoder, name, _OFF_WHILE_PROFILING[name])
    return saved


@dataclass(frozen=True)
class Workload:
    """What ``profile_split`` has both decoders generate: each prompt alone, ``max_new_tokens`` past it
    (EOS ignored), at ``temperature`` (0: greedy) from ``seed`` (used only when sampling)."""

    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0

    def generate_kwargs(self) -> dict:
        """``generate``'s keywords for one call (the prompt aside)."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    seed=self.seed if self.temperature > 0 else None, ignore_eos=True)


def profile_split(decoder, ar_decoder, drafter, work: Workload, *, phases: tuple[str, ...],
                  device: torch.device | None = None, clock=time.perf_counter) -> dict:
    """Time ``decoder``'s step phases against ``ar_decoder``'s step on ``work``; return the split.

    ``decoder`` must have step hooks (``hooks``, a ``step.StepHooks``: a ``SpecDecoder``); they are restored,
    and so are ``trim_last_steps`` and ``lookup_ngram``, off while it runs (every step then drafts the
    configured depth with the drafter).
    ``drafter``: the decoder's drafter, whose ``draft_forward`` and ``compute_logits`` calls are counted
    and timed (None: none).
    Both decoders get one warm-up call on ``work.prompts[0]``, then each prompt runs on both, one call each.
    Returns a dict: ``ar_step_ms``, ``step_ms``, ``steps``, ``mean_accepted_length``,
    ``phase_ms`` and ``ar_steps`` (phase -> ms per step and fraction of one ``ar`` step, including
    ``"unaccounted"``: the step minus its phases), ``step_ar_steps``, ``step_without_drafting_ar_steps``,
    ``drafter_calls_per_step``, ``drafter_call_ms``, ``drafter_call_ar_steps``, and the same call split
    into each step's first call, its catch-up (``catch_up_call_ms``, ``catch_up_call_ar_steps``; split again
    into each request's first, over its prompt, ``prompt_catch_up_call_*``, and the rest, after a verify
    step, ``step_catch_up_call_*``), and
    the drafting calls after it (``draft_call_ms``, ``draft_call_ar_steps``); the drafter's logits
    (``drafter_logits_calls_per_step``, ``drafter_logits_ms`` and ``drafter_logits_ar_steps`` per call), and
    the rest of the drafting phase per step, outside both (``drafting_rest_ms``, ``drafting_rest_ar_steps``:
    sampling or top-k, tree bookkeeping, the draft NaN pass); None without a drafter (or, for the split,
    without such calls).
    """
    from spec_decode.step import StepHooks

    if not isinstance(getattr(decoder, "hooks", None), StepHooks):
        raise TypeError(f"{type(decoder).__name__} has no step hooks (hooks, a StepHooks); spec-bench profile needs "
                        "a SpecDecoder, whose steps time their phases (spec_decode.step.PHASES)")
    prompts = work.prompts
    if not prompts:
        raise ValueError("prompts must not be empty")
    sampling = work.generate_kwargs()
    phase_clock = PhaseClock(device, clock)
    call_clock = CallClock(device, clock, step_id=lambda: phase_clock.entries.get("drafting", 0))
    logits_clock = CallClock(device, clock, method="compute_logits", outer=call_clock)
    previous = decoder.hooks
    ar_steps, steps, accepted = [], [], []
    saved = _switch_off(decoder)
    try:
        for dec in (ar_decoder, decoder):   # warm-up
            dec.generate(prompts[:1], **sampling)
        decoder.hooks = replace(previous, timer=phase_clock)
        if drafter is not None:
            call_clock.attach(drafter)
            if hasattr(drafter, "compute_logits"):
                logits_clock.attach(drafter)
        for p in prompts:
            ar_decoder.generate([p], **sampling)
            ar_steps += ar_decoder.last_stats.step_s
            call_clock.new_request()
            results = decoder.generate([p], **sampling)
            steps += decoder.last_stats.step_s
            accepted += [n for r in results for n in r.accepted_lengths]
    finally:
        decoder.hooks = previous
        for name, value in saved.items():
            setattr(decoder, name, value)
        call_clock.detach()
        logits_clock.detach()
    if drafter is not None and steps and not call_clock.calls:
        raise RuntimeError("the decoder never called drafter.draft_forward: pass the drafter the decoder runs")
    return _split(phases, phase_clock.seconds, call_clock, logits_clock, ar_steps, steps, accepted,
                  drafter is not None)


def _split(phases, phase_seconds: dict, calls: CallClock, logits: CallClock, ar_steps: list, steps: list,
           accepted: list, has_drafter: bool) -> dict:
    n = max(1, len(steps))
    ar = sum(ar_steps) / max(1, len(ar_steps))
    step = sum(steps) / n
    phase_ms = {name: phase_seconds.get(name, 0.0) / n * 1e3 for name in phases}
    phase_ms.update({name: s / n * 1e3 for name, s in phase_seconds.items() if name not in phase_ms})
    phase_ms[UNACCOUNTED] = step * 1e3 - sum(phase_ms.values())
    frac = {name: ms / (ar * 1e3) if ar > 0 else None for name, ms in phase_ms.items()}
    return {
        "ar_step_ms": ar * 1e3,
        "step_ms": step * 1e3,
        "steps": len(steps),
        "mean_accepted_length": sum(accepted) / len(accepted) if accepted else None,
        "phase_ms": phase_ms,
        "ar_steps": frac,
        "step_ar_steps": step / ar if ar > 0 else None,
        "step_without_drafting_ar_steps": (step * 1e3 - phase_ms.get("drafting", 0.0)) / (ar * 1e3) if ar > 0 else None,
        "drafter_calls_per_step": calls.calls / n if has_drafter else None,
        **_per_call("drafter_call", calls.seconds, calls.calls, ar),
        **_per_call("catch_up_call", calls.catch_up_seconds, calls.catch_up_calls, ar),
        **_per_call("prompt_catch_up_call", calls.prompt_catch_up_seconds, calls.prompt_catch_up_calls, ar),
        **_per_call("step_catch_up_call", calls.catch_up_seconds - calls.prompt_catch_up_seconds,
                    calls.catch_up_calls - calls.prompt_catch_up_calls, ar),
        **_per_call("draft_call", calls.seconds - calls.catch_up_seconds, calls.calls - calls.catch_up_calls,
                    ar),
        "drafter_logits_calls_per_step": logits.calls / n if has_drafter else None,
        **_per_call("drafter_logits", logits.seconds, logits.calls, ar),
        **_drafting_rest(phase_ms.get("drafting", 0.0) - (calls.seconds + logits.seconds) / n * 1e3, ar,
                         has_drafter),
    }


def _drafting_rest(ms: float, ar: float, has_drafter: bool) -> dict:
    """The drafting phase per step outside the drafter's forwards and logits (None without a drafter)."""
    return {"drafting_rest_ms": ms if has_drafter else None,
            "drafting_rest_ar_steps": ms / (ar * 1e3) if has_drafter and ar > 0 else None}


def _per_call(name: str, seconds: float, calls: int, ar: float) -> dict:
    """``{name}_ms`` and ``{name}_ar_steps`` of the mean call (None without calls)."""
    s = seconds / calls if calls else None
    return {f"{name}_ms": None if s is None else s * 1e3,
            f"{name}_ar_steps": None if s is None or ar <= 0 else s / ar}


def format_split(title: str, split: dict) -> str:
    """The split as a text table (ms per step and fractions of one ``ar`` step)."""
    def num(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    lines = [title,
             f"one ar step: {num(split['ar_step_ms'])} ms; speculative step: {num(split['step_ms'])} ms = "
             f"{num(split['step_ar_steps'], '.2f')} ar steps; {split['steps']} steps, mean accepted length "
             f"{num(split['mean_accepted_length'], '.2f')}",
             f"  {'phase':34s} {'ms/step':>9s} {'ar steps':>9s}"]
    for name, ms in split["phase_ms"].items():
        label = {"verify_walk": "verify_walk (incl. NaN pass)", "drafting": "drafting (incl. catch-up)",
                 UNACCOUNTED: "unaccounted (step minus phases)"}.get(name, name)
        lines.append(f"  {label:34s} {ms:9.3f} {num(split['ar_steps'][name], '9.3f')}")
    lines.append(f"  {'step without drafting':34s} {'':9s} {num(split['step_without_drafting_ar_steps'], '9.3f')}")
    if split["drafter_calls_per_step"] is not None:
        lines.append(f"  one drafter call: {num(split['drafter_call_ms'])} ms = "
                     f"{num(split['drafter_call_ar_steps'])} ar steps ({split['drafter_calls_per_step']:.2f} calls "
                     "per step)")
    if split.get("catch_up_call_ms") is not None:
        lines.append(f"    the catch-up (a step's first call): {num(split['catch_up_call_ms'])} ms = "
                     f"{num(split['catch_up_call_ar_steps'])} ar steps; each later call: "
                     f"{num(split['draft_call_ms'])} ms = {num(split['draft_call_ar_steps'])} ar steps")
    if split.get("prompt_catch_up_call_ms") is not None:
        lines.append(f"      of which a request's first (its whole prompt): "
                     f"{num(split['prompt_catch_up_call_ms'])} ms = "
                     f"{num(split['prompt_catch_up_call_ar_steps'])} ar steps; after a verify step: "
                     f"{num(split['step_catch_up_call_ms'])} ms = {num(split['step_catch_up_call_ar_steps'])} ar steps")
    if split.get("drafter_logits_ms") is not None:
        lines.append(f"  its logits (compute_logits): {num(split['drafter_logits_ms'])} ms = "
                     f"{num(split['drafter_logits_ar_steps'])} ar steps ({split['drafter_logits_calls_per_step']:.2f} "
                     "per step)")
    if split.get("drafting_rest_ms") is not None:
        lines.append(f"  drafting outside the drafter's calls and logits: {num(split['drafting_rest_ms'])} ms = "
                     f"{num(split['drafting_rest_ar_steps'])} ar steps per step")
    return "\n".join(lines)


def cprofile_top(decoder, prompts: list[list[int]], max_new_tokens: int, top: int, *, temperature: float = 0.0,
                 seed: int = 0) -> str:
    """cProfile of ``generate`` at ``temperature`` over ``prompts`` (one call each, seeded as the split's
    pass): the top ``top`` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for p in prompts:
        decoder.generate([p], max_new_tokens=max_new_tokens, temperature=temperature,
                         seed=seed if temperature > 0 else None, ignore_eos=True)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def verify_cost(target, prompts: list[list[int]], block_tokens: int, repeats: int = 5) -> dict:
    """What one ``block_tokens``-token verify forward costs in one-token steps: the regime a drafter
    must exploit (a weight-bound model verifies a block for about the price of one token).

    Per prompt, ``verify_cost.time_verify_blocks`` (the library's calibration of ``lookup_tokens="auto"``
    times blocks the same way): the prompt prefilled and committed, then a 1-token and a
    ``block_tokens``-token forward at the next position alternate ``repeats`` times. Returns the median
    1-token ms, the median block ms and their ratio.
    """
    one, block = [], []
    for prompt in prompts:
        times = time_verify_blocks(target, prompt, (1, block_tokens), repeats)
        one += times[1]
        block += times[block_tokens]
    one_ms, block_ms = statistics.median(one) * 1e3, statistics.median(block) * 1e3
    return {"block_tokens": block_tokens, "one_token_ms": one_ms, "block_ms": block_ms,
            "block_ar_steps": block_ms / one_ms, "calls": 2 * repeats * len(prompts)}


def build_parser() -> argparse.ArgumentParser:
    ours = [k for k, s in METHOD_SPECS.items() if s.speculative and s.drafter]
    p = argparse.ArgumentParser(prog="spec-bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="eagle_chain", help=f"one of {','.join(ours)} (default eagle_chain)")
    add_input_args(p)
    add_run_args(p, num_prompts=8, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=nonneg_float, default=0.0)
    add_dtype_arg(p)
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--verify-tokens", type=positive_int, default=None, metavar="N",
                   help="instead of a method's split: the cost of one N-token verify forward of the target in "
                        "one-token steps (--method is then not used); the longest prompt plus N must fit the "
                        "target's max_position_embeddings")
    p.add_argument("--suite", choices=("smollm2",), default=None,
                   help="smollm2: the real model's cached target and its chat prompts instead of --target and "
                        "--prompts")
    p.add_argument("--cprofile", type=nonneg_int, default=0, metavar="N",
                   help="also print the top N functions by own time, from a separate cProfile pass (0: none)")
    p.add_argument("--json", type=new_file, default=None,
                   help="also write the split to this JSON file (checked writable before the run)")
    add_compile_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from spec_decode.bench.methods import ModelCache
    from spec_decode.bench.harness import check_inputs
    from spec_decode.step import PHASES

    p = build_parser()
    args = p.parse_args(argv)
    if args.suite == "smollm2":
        _use_smollm2(p, args)
    if args.verify_tokens is not None:
        return _verify_cost_main(p, args)
    spec = METHOD_SPECS.get(args.method)
    if spec is None or not spec.speculative or not spec.drafter:
        p.error(f"--method: expected one of our speculative methods, got {args.method!r}")
    try:
        device = args.device
        dtype = args.dtype or default_dtype_name(device.type)
        cfg = BenchConfig(**input_paths(args), methods=("ar", args.method), num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, temperatures=(args.temperature,), dtypes=(dtype,),
                          threads=args.threads, device=str(device), nan_rounds=0, compile=args.compile)
        if cfg.resolve_methods() != ("ar", args.method):
            raise BenchInputError(f"--method {args.method}: {cfg.skipped[args.method]}")
        vocab = check_inputs(cfg, ("ar", args.method))
        prompts = load_prompts(cfg.prompts, cfg.num_prompts, vocab)[:cfg.num_prompts]
        models = ModelCache(cfg, dtype, device)
        runner, ar = models.runner(spec), models.runner(METHOD_SPECS["ar"])
    except ValueError as e:   # BenchInputError and BenchConfig's checks name the option
        p.error(str(e))
    with torch_threads(cfg.threads):
        work = Workload(prompts, args.max_new_tokens, args.temperature, cfg.seed)
        split = profile_split(runner.decoder, ar.decoder, runner.modules[1], work, phases=PHASES,
                              device=device)
        title = (f"{args.method} ({spec.num_steps}/{spec.topk}/{spec.num_draft_tokens}"
                 f"{', its lookup steps off' if spec.lookup_ngram else ''}), {dtype}"
                 f"{', compiled' if cfg.compile else ''}, "
                 f"temperature {args.temperature:g}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
                 f"{torch.get_num_threads()} thread(s)")
        print(format_split(title, split))
        write_json(p, args.json, {"method": args.method, "config": spec.describe(), "dtype": dtype,
                                  "temperature": args.temperature, "num_prompts": len(prompts),
                                  "max_new_tokens": args.max_new_tokens, **split})
        if args.cprofile > 0:
            print(cprofile_top(runner.decoder, prompts, args.max_new_tokens, args.cprofile,
                               temperature=args.temperature, seed=cfg.seed))
    return 0


def write_json(p: argparse.ArgumentParser, path, data: dict) -> None:
    """Write ``data`` to ``--json`` ``path`` (None: nothing). A full disk or ``/dev/full`` is known only on
    writing: then the JSON goes to stdout, so that nothing measured is lost, and the command exits with
    status 2 naming ``--json``."""
    if path is None:
        return
    text = json.dumps(data, indent=2)
    try:
        path.write_text(text)
    except OSError as e:
        print(text)
        p.error(f"--json {path}: cannot write it ({e.strerror or e}); the results are printed above")


def _verify_cost_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--verify-tokens N``: ``verify_cost`` over the prompts, printed (and written to ``--json``)."""
    from spec_decode.bench.methods import ModelCache
    from spec_decode.bench.harness import check_models

    try:
        device = args.device
        dtype = args.dtype or default_dtype_name(device.type)
        cfg = BenchConfig(**input_paths(args), methods=("ar",), num_prompts=args.num_prompts,
                          max_new_tokens=args.verify_tokens, dtypes=(dtype,), threads=args.threads,
                          device=str(device), nan_rounds=0)
        config = check_models(cfg.target, {})
        prompts = load_prompts(cfg.prompts, cfg.num_prompts, config.vocab_size)
        # a block of N rows after the longest prompt (the warm-up one included) must fit the positions
        check_room(args.verify_tokens, config.max_position_embeddings, prompts, option="--verify-tokens")
        prompts = prompts[:cfg.num_prompts]
        target = ModelCache(cfg, dtype, device).get("target")
    except ValueError as e:
        p.error(str(e))
    with torch_threads(cfg.threads):
        verify_cost(target, prompts[:1], args.verify_tokens, repeats=1)   # warm-up
        cost = verify_cost(target, prompts, args.verify_tokens)
        threads = torch.get_num_threads()
    print(f"{cfg.target.name}, {dtype}, {threads} thread(s), {len(prompts)} prompts: one "
          f"{args.verify_tokens}-token verify forward {cost['block_ms']:.2f} ms = {cost['block_ar_steps']:.3f} "
          f"one-token steps ({cost['one_token_ms']:.2f} ms)")
    write_json(p, args.json, {"target": str(cfg.target), "dtype": dtype, **cost})
    return 0


def _use_smollm2(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--suite smollm2``: point ``--target`` and ``--prompts`` at the real model and its chat set, and
    ``--eagle``/``--eagle3`` left at their defaults (the tiny target's heads) at the real model's heads."""
    from spec_decode.bench.prompt_sets import smollm2_prompt_file
    from spec_decode.bench.suites import smollm2_heads
    from spec_decode.fixtures import smollm2_target_dir

    try:
        args.target = smollm2_target_dir()
        args.prompts = smollm2_prompt_file("chat")
    except ImportError as e:
        p.error(f"--suite smollm2: {e}")
    defaults = {name: p.get_default(name) for name in ("eagle", "eagle3")}
    for name, path in smollm2_heads().items():
        if getattr(args, name) == defaults[name]:
            setattr(args, name, path)
