"""``spec-bench gpu-check``: a few-minute CUDA check of everything that a CPU run cannot show.

Steps (each prints PASS/FAIL; the exit code is the number of failures):

1. ``triton-vs-torch``: the Triton ``nan_counts_per_request`` kernel, compiled for real (no
   interpreter), against the torch reference: identical counts and bit-identical sanitized logits,
   bf16/fp16/fp32, NaN/+-Inf at the first, middle and last rows;
2. ``numerics``: the micro-benchmark on one verify shape per dtype, our path under
   ``set_sync_debug_mode("error")`` (zero host syncs asserted);
3. ``pytest``: ``tests/samplers/test_samplers_flashinfer.py`` (FlashInfer chain comparison; it
   skips, naming the reason, when flashinfer is absent) and ``tests/numerics/test_numerics_cuda_sync.py``,
   when run from a source checkout;
4. ``bench``: a small bf16 end-to-end run (2 prompts x 16 tokens; ar, eagle_tree, eagle3_tree)
   whose NaN-policy stage asserts a sync-free numerics pass inside the real pipeline;
5. ``invariant``: the batch-invariant CUDA halves (``spec_decode.cuda``), compiled for real: each row
   of ``invariant_linear`` and of ``invariant_attention`` gives the same bits alone as in a block, both
   agree with their torch references to float32 rounding, and their time against ``F.linear`` and
   SDPA at a verify shape is printed (``check_invariant_kernels``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PYTEST_FILES = ("tests/samplers/test_samplers_flashinfer.py", "tests/numerics/test_numerics_cuda_sync.py")


def check_triton_matches_torch(device: torch.device) -> None:
    """Raise AssertionError when the compiled kernel and the torch reference disagree."""
    from numerics import nan_counts_per_request

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, vocab in ((8, 32000), (24, 151936), (5, 99)):
            x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
            for r, val in ((0, float("nan")), (rows // 2, float("inf")), (rows - 1, float("-inf"))):
                x[r, torch.randint(vocab, (3,), generator=g)] = val
            x[rows - 1, 0] = float("nan")
            x = x.to(device)
            cu = torch.tensor(sorted({0, rows // 3, rows // 2, rows}), device=device, dtype=torch.int32)
            a, b = x.clone(), x.clone()
            ca = nan_counts_per_request(a, cu, sanitize=True, backend="triton")
            cb = nan_counts_per_request(b, cu, sanitize=True, backend="torch")
            assert torch.equal(ca, cb), f"{dtype} {rows}x{vocab}: counts {ca.tolist()} != {cb.tolist()}"
            bits = torch.int16 if dtype != torch.float32 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits)), f"{dtype} {rows}x{vocab}: sanitized bits differ"


def _cuda_ms(fn, repeats: int = 50) -> float:
    """Median ms of ``fn()`` on the current CUDA stream (events around each call, after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check_invariant_rows(device: torch.device, rows: int = 6, width: int = 576, out: int = 1536,
                         keys: int = 300) -> tuple:
    """Each row of ``invariant_linear`` and ``invariant_attention`` gives the same bits alone as in a block
    of ``rows``, and both agree with their torch references to float32 rounding, in bf16 and float32.
    AssertionError naming the kernel, dtype and row otherwise. Returns the last dtype's inputs
    (x, w, q, keys and values, mask) for timing."""
    from spec_decode.cuda.invariant_attention import invariant_attention, invariant_attention_reference
    from spec_decode.cuda.invariant_linear import invariant_linear, invariant_linear_reference

    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, width, generator=g).to(device, dtype)
        w = (torch.randn(out, width, generator=g) / width ** 0.5).to(device, dtype)
        block = invariant_linear(x, w)
        for r in range(rows):
            assert torch.equal(invariant_linear(x[r:r + 1], w), block[r:r + 1]), f"linear {dtype}: row {r} differs"
        torch.testing.assert_close(block, invariant_linear_reference(x, w).to(dtype))   # dtype's tolerance
        q = torch.randn(1, 3, rows, 64, generator=g).to(device, dtype)
        kv = [torch.randn(1, 3, keys, 64, generator=g).to(device, dtype) for _ in range(2)]
        mask = torch.ones(1, 1, rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
        att = invariant_attention(q, *kv, mask, 0.125)
        for r in range(rows):
            one = invariant_attention(q[:, :, r:r + 1], *kv, mask[:, :, r:r + 1], 0.125)
            assert torch.equal(one, att[:, :, r:r + 1]), f"attention {dtype}: row {r} differs"
        torch.testing.assert_close(att, invariant_attention_reference(q, *kv, mask, 0.125).to(dtype))
    return x, w, q, kv, mask


def check_invariant_kernels(device: torch.device, rows: int = 6) -> None:
    """``check_invariant_rows`` at SmolLM2's shapes, then the kernels' time at a verify block of ``rows``
    tokens against ``F.linear`` and SDPA (printed)."""
    import torch.nn.functional as F

    from spec_decode.cuda.invariant_attention import invariant_attention
    from spec_decode.cuda.invariant_linear import invariant_linear

    x, w, q, kv, mask = check_invariant_rows(device, rows)
    lin = _cuda_ms(lambda: invariant_linear(x, w)) / _cuda_ms(lambda: F.linear(x, w))
    sdpa = _cuda_ms(lambda: invariant_attention(q, *kv, mask, 0.125)) / _cuda_ms(
        lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=0.125))
    print(f"  invariant fp32, {rows} rows: linear {tuple(w.shape)} {lin:.2f}x F.linear, attention over "
          f"{mask.shape[-1]} keys {sdpa:.2f}x SDPA", flush=True)


def _step(name: str, fn) -> bool:
    t0 = time.perf_counter()
    try:
        fn()
    except (Exception, SystemExit) as e:   # report every step, then fail by exit code
        print(f"FAIL {name} ({time.perf_counter() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
        return False
    print(f"PASS {name} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return True


def _pytest(repo: Path) -> None:
    files = [f for f in PYTEST_FILES if (repo / f).is_file()]
    if not files:
        raise FileNotFoundError(f"none of {PYTEST_FILES} under {repo} (run from a source checkout)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # compile for real
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *files], cwd=repo, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited with {proc.returncode}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spec-bench gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/gpu_check"))
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="source checkout holding tests/ (default: cwd)")
    p.add_argument("--skip-pytest", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("CUDA is not available: gpu-check needs a GPU (run 'spec-bench numerics' on CPU instead)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: unset it so that the Triton kernel is compiled for real")
    device = torch.device("cuda")
    from spec_decode.bench.side_by_side import main as bench_main
    from spec_decode.bench.numerics_bench import main as numerics_main

    ok = [
        _step("triton-vs-torch", lambda: check_triton_matches_torch(device)),
        _step("numerics", lambda: numerics_main(["--device", "cuda", "--rows", "64", "--vocabs", "151936",
                                                 "--min-run-time", "0.1", "--out", str(args.out)])),
    ]
    if not args.skip_pytest:
        ok.append(_step("pytest", lambda: _pytest(args.repo)))
    ok.append(_step("bench", lambda: bench_main(
        ["--num-prompts", "2", "--max-new-tokens", "16", "--methods", "ar,eagle_tree,eagle3_tree",
         "--temperatures", "0", "--dtype", "bf16", "--nan-rounds", "1", "--out", str(args.out)])))
    ok.append(_step("invariant", lambda: check_invariant_kernels(device)))
    failures = ok.count(False)
    print(f"gpu-check: {len(ok) - failures}/{len(ok)} steps passed")
    return failures
