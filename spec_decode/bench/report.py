"""Figure and text table of a ``results.json``."""

from __future__ import annotations

from pathlib import Path

from spec_decode.bench.config import METHOD_KEYS


def _run_methods(results: dict) -> list[str]:
    return [k for k in METHOD_KEYS if k in results["methods"] and "skipped" not in results["methods"][k]]


def plot_results(results: dict, path: Path) -> None:
    """Write the figure: speedup over ``ar`` per method and temperature (left), and the histogram
    of accepted lengths per verify step of each speculative method at the headline temperature (right)."""
    import matplotlib

    matplotlib.use("Agg", force=False)   # no display needed; a no-op when a backend is already set
    import matplotlib.pyplot as plt

    keys = _run_methods(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    temps = list(next(iter(results["methods"][k]["by_temperature"] for k in keys))) if keys else []
    width = 0.8 / max(1, len(temps))
    for j, t in enumerate(temps):
        vals = [results["methods"][k]["by_temperature"][t]["speedup_vs_ar"] or 0.0 for k in keys]
        bars = ax1.bar([i + j * width for i in range(len(keys))], vals, width, label=f"temperature {t}")
        ax1.bar_label(bars, fmt="%.2f", fontsize=7)
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(keys))], keys, rotation=30, ha="right")
    ax1.set_ylabel("speedup over ar (tokens/s ratio)")
    cfg = results["config"]
    ax1.set_title(f"{cfg['headline_dtype']}, batch {cfg['batch_size']}, {cfg['num_prompts']} prompts x "
                  f"{cfg['max_new_tokens']} tokens", fontsize=9)
    if temps:
        ax1.legend(fontsize=8)

    spec_keys = [k for k in keys if results["methods"][k].get("accepted_length_hist")]
    width = 0.8 / max(1, len(spec_keys))
    for j, k in enumerate(spec_keys):
        hist = results["methods"][k]["accepted_length_hist"]
        total = sum(hist.values())
        xs = [int(n) + (j - (len(spec_keys) - 1) / 2) * width for n in hist]
        ax2.bar(xs, [c / total for c in hist.values()], width,
                label=f"{k} (mean {results['methods'][k]['mean_accepted_length']:.2f})")
    longest = max((int(n) for k in spec_keys for n in results["methods"][k]["accepted_length_hist"]), default=1)
    ax2.set_xticks(range(1, longest + 1))
    ax2.set_xlabel("tokens emitted per verify step (accepted drafts + 1)")
    ax2.set_ylabel("fraction of verify steps")
    ax2.set_title("accepted lengths, headline temperature", fontsize=9)
    if spec_keys:
        ax2.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"spec-bench  {m['date']}  {m['cpu']}" + (f" / {m['cuda_device']}" if m["cuda_device"] else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def markdown_table(results: dict) -> str:
    """A Markdown table of the headline numbers (plus bf16 tokens/s when that dtype ran too)."""
    other = results.get("by_dtype", {})
    cols = ["method", "tokens/s", "x ar", "x hf_generate", "accepted len", "p50 step ms", "p90 step ms",
            "peak MB", "greedy == ar"]
    temps = list(next(iter(v["by_temperature"] for v in results["methods"].values() if "by_temperature" in v),
                      {}))
    extra_temps = [t for t in temps if float(t) != results_headline_temp(results)]
    cols += [f"tokens/s T={t}" for t in extra_temps] + [f"x ar T={t}" for t in extra_temps]
    cols += [f"{d} tokens/s" for d in other] + [f"{d} x ar" for d in other]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for k, e in results["methods"].items():
        if "skipped" in e:
            lines.append(f"| {k} | skipped: {e['skipped']} |" + " |" * (len(cols) - 2))
            continue
        row = [k, _fmt(e["tokens_per_s"], ".1f"), _fmt(e["speedup_vs_ar"]), _fmt(e["speedup_vs_hf_generate"]),
               _fmt(e["mean_accepted_length"]), _fmt(e["p50_step_ms"]), _fmt(e["p90_step_ms"]),
               _fmt(e["peak_mem_mb"], ".0f"), _fmt(e["greedy_equals_ar"])]
        row += [_fmt(e["by_temperature"][t]["tokens_per_s"], ".1f") for t in extra_temps]
        row += [_fmt(e["by_temperature"][t]["speedup_vs_ar"]) for t in extra_temps]
        for d in other:
            o = other[d]["methods"].get(k, {})
            row.append(_fmt(o.get("tokens_per_s"), ".1f"))
        for d in other:
            o = other[d]["methods"].get(k, {})
            row.append(_fmt(o.get("speedup_vs_ar")))
        lines.append("| " + " | ".join(row) + " |")
    nan = results.get("nan_policy_overhead_pct", {})
    lines.append("")
    lines.append("NaN policy overhead (EAGLE tree, % of step time vs off): "
                 + ", ".join(f"{m} {_fmt(v)}" for m, v in nan.items()))
    detail = results.get("nan_policy", {})
    if "nan_pass_ms" in detail:
        lines.append(f"numerics pass alone at the verify shape: {detail['nan_pass_ms']:.3f} ms = "
                     f"{detail['nan_pass_pct_of_p50_step']:.2f}% of the p50 step")
    lines.append(invariance_line(results))
    return "\n".join(lines)


def invariance_line(results: dict) -> str:
    """Which methods ran with the batch-invariant routes in force (``SpecDecoder.batch_invariant``), and the CPU."""
    configs = results["config"].get("method_configs", {})
    on = [k for k, c in configs.items() if c.get("batch_invariant") is True]
    off = [k for k, c in configs.items() if c.get("batch_invariant") is False]
    return (f"batch-invariant routes: in force for {', '.join(on) or 'none'}; off for {', '.join(off) or 'none'} "
            f"({results['machine'].get('cpu_routes', 'CPU routes not recorded')})")


def results_headline_temp(results: dict) -> float:
    for e in results["methods"].values():
        if "headline_temperature" in e:
            return e["headline_temperature"]
    return 0.0


def plot_tune(results: dict, path: Path) -> None:
    """Write the figure of ``spec-bench tune``: one panel per temperature, tokens/s over ``ar`` per
    shape (chains and trees in two colours, the best shape outlined), mean accepted length on each bar."""
    import matplotlib

    matplotlib.use("Agg", force=False)   # no display needed; a no-op when a backend is already set
    import matplotlib.pyplot as plt

    temps = list(results["by_temperature"])
    fig, axes = plt.subplots(max(1, len(temps)), 1, figsize=(11, 3.6 * max(1, len(temps))), squeeze=False)
    for ax, t in zip(axes[:, 0], temps):
        r = results["by_temperature"][t]
        keys = list(r["shapes"])
        vals = [r["shapes"][k]["speedup_vs_ar"] or 0.0 for k in keys]
        colors = ["tab:orange" if r["shapes"][k]["chain"] else "tab:blue" for k in keys]
        bars = ax.bar(range(len(keys)), vals, color=colors,
                      edgecolor=["black" if k == r["best"] else "none" for k in keys], linewidth=2)
        ax.bar_label(bars, labels=[_fmt(r["shapes"][k]["mean_accepted_length"]) for k in keys], fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s over ar")
        ax.set_title(f"temperature {t}: best {r['best']} (orange: chains, blue: trees; "
                     "bar labels: mean accepted length)", fontsize=9)
    cfg, m = results["config"], results["machine"]
    fig.suptitle(f"spec-bench tune  {cfg['method']}, {cfg['dtype']}, {cfg['num_prompts']} prompts x "
                 f"{cfg['max_new_tokens']} tokens  {m['date']}  {m['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
