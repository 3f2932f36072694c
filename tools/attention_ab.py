"""The attention block kernel of two source trees, in one process: ``safespec_attention_block`` at
SmolLM2-135M-Instruct's shapes (9 query heads over 3 kv heads, head dim 64), bf16, over a committed
context of each length, for blocks of each token count, the two builds' calls alternated, the median of
each.

    taskset -c 1 python tools/attention_ab.py BASE_TREE NEW_TREE --contexts 150,300,600 --tokens 1,4

Each tree's kernel is built (or found) in the cache by that tree's own ``cpu_gemm`` (``kernel_ab``), and
both read the same inputs, so their outputs are compared too. docs/performance.md keeps the figures.
"""
import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from kernel_ab import built_kernel
from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.attention import attention_block_args
from spec_decode.fixtures import smollm2_target_dir
from spec_decode.models.masks import BlockPlacement, block_inputs
from spec_decode.models.transformer import Transformer


def attention_function(tree: Path, like):
    """``tree``'s ``safespec_attention_block``, with ``like``'s argument and result types."""
    fn = ctypes.CDLL(built_kernel(tree)).safespec_attention_block
    fn.argtypes, fn.restype = like.argtypes, like.restype
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--contexts", default="150,300,600")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    like = cpu_gemm.loaded_kernels().attention_block
    fns = [attention_function(tree, like) for tree in (args.base, args.new)]
    target = Transformer.from_pretrained(smollm2_target_dir(), dtype=dtype)
    cfg = target.config
    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    torch.manual_seed(0)
    for context in (int(c) for c in args.contexts.split(",")):
        cache = target.new_cache(1, context + 64)
        cache.lengths.fill_(context)
        cache.k.normal_(), cache.v.normal_()
        for T in (int(t) for t in args.tokens.split(",")):
            li = block_inputs(target, cache, T, dtype, BlockPlacement(None, None, None, None, None))
            qkv = torch.randn(1, T, (nh + 2 * nkv) * D, dtype=dtype)
            outs = [torch.empty(1, T, nh * D, dtype=dtype) for _ in fns]
            rest = attention_block_args((li.cos, li.sin), li.write_pos, (cache.k[0], cache.v[0]), li.mask)
            times: list[list[float]] = [[], []]
            for i in range(args.calls):
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    start = time.perf_counter()
                    fns[j](1, T, nh, nkv, D, qkv.data_ptr(), 1, *rest, D ** -0.5, outs[j].data_ptr())
                    times[j].append(time.perf_counter() - start)
            base, new = (statistics.median(t) * 1e6 for t in times)
            same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
            print(f"context {context:4d} tokens {T:2d}  base {base:7.1f} us  new {new:7.1f} us  "
                  f"new/base {new / base:.3f}  same bits {same}", flush=True)


if __name__ == "__main__":
    main()
