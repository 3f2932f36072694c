"""The decoder layers: RMSNorm, grouped-query attention over the KV cache, the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks

from spec_decode.cpu import Linear, cpu_gemm, set_invariant_linears
from spec_decode.cpu.capability import KERNELS_MISSING
from spec_decode.cpu.attention import attention_block, attention_block_fits, invariant_attention
from spec_decode.cpu.layer import LayerWeights, decoder_layer, decoder_layer_fits
from spec_decode.cpu.mlp import silu_mul
from spec_decode.cpu.norm import invariant_rms_norm
from spec_decode.models.config import ModelConfig
from spec_decode.models.rope import apply_rope
from spec_decode.models.kv_cache import KVCache
from spec_decode.models.masks import LayerInputs


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight multiply (as HF Llama).

    ``batch_invariant`` (None or True: on; False: off; ``set_batch_invariant``): on the CPU, in float32 and
    bf16 where ``cpu_gemm.available()``, eager and without autograd, it is one C call in one fixed order
    (``spec_decode.cpu.norm``); elsewhere, and off, the torch expression below.
    """

    batch_invariant: bool | None = None

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self._invariant(x):
            return invariant_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        # the casts are skipped, not made no-ops, in float32: a no-op cast is still an op call
        xf = x if dtype == torch.float32 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (xf if dtype == torch.float32 else xf.to(dtype))

    def _invariant(self, x: Tensor) -> bool:
        """Whether this call takes the C kernel (see the class docstring)."""
        w = self.weight
        return (self.batch_invariant is not False and x.is_cpu and x.dtype in cpu_gemm.KERNEL_DTYPES
                and w.dtype is x.dtype and not ((x.requires_grad or w.requires_grad) and torch.is_grad_enabled())
                and not torch.compiler.is_compiling() and cpu_gemm.available())


def _zero_nonfinite_rows(keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero every K/V row holding NaN/Inf; return the rows' finiteness. Shape: (B, nkv, S, D) -> ..., (B, nkv, S).

    float32 row sums are finite exactly when the row is (K/V magnitudes are far below 1e36).
    """
    finite = torch.isfinite(keys.sum(-1, dtype=torch.float32) + values.sum(-1, dtype=torch.float32))
    bad = ~finite[..., None]
    return keys.masked_fill(bad, 0), values.masked_fill(bad, 0), finite


def _keep_published_keys(module: nn.Module, fused: str, parts: tuple[tuple[str, int], ...]) -> None:
    """Checkpoints keep ``parts`` (published names and row counts) that ``module.<fused>`` holds concatenated.

    ``state_dict()`` splits ``<fused>.weight``/``.bias`` into ``<part>.weight``/``.bias`` (copies, so that
    safetensors can save them; views of the parameter with ``keep_vars=True``), and ``load_state_dict``
    concatenates the parts back: one matmul at run time, the published layout on disk.
    """
    def split(mod, state, prefix, local_metadata) -> None:
        for suffix in ("weight", "bias"):
            t = state.pop(f"{prefix}{fused}.{suffix}", None)
            if t is None:
                continue
            for name, rows in zip((n for n, _ in parts), t.split([r for _, r in parts])):
                state[f"{prefix}{name}.{suffix}"] = rows if isinstance(t, nn.Parameter) else rows.clone()

    def join(mod, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{name}.{suffix}" for name, _ in parts]
            if all(k in state for k in keys):
                state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(k) for k in keys])

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


class Attention(nn.Module):
    """GQA self-attention over the KV cache; ``in_dim`` differs from hidden_size only in EAGLE-3 (2H).

    q/k/v are one linear, ``qkv_proj`` (fused at load time; checkpoints keep ``q_proj``/``k_proj``/``v_proj``),
    and rope rotates q and k in one pass.

    ``exact_nan``: NaN/Inf in a K/V row reaches exactly the queries that may attend to it, as in
    exact arithmetic, instead of every query of the block (plain SDPA computes 0 * NaN = NaN for
    masked rows). This keeps a NaN tree branch from poisoning its siblings and a poisoned position
    from poisoning the tokens before it; finite results are unchanged. It costs about 10 small ops
    per layer, so ``set_exact_nan`` turns it on by default only for float16, where overflow makes NaN
    part of normal operation.

    ``batch_invariant`` (None or True: on; False: off; ``set_batch_invariant``): on the CPU, in float32
    and bf16 where ``cpu_gemm.available()``, eager and without autograd, each query row attends alone
    over the keys it may see, in cache-row order (``spec_decode.cpu.attention``), so its bits depend
    neither on ``kv_len``, the block width nor the batch; with ``exact_nan`` off, rope, the cache writes
    and that attention are one C call (``attention_block``, the same bits). Elsewhere, and off, it is SDPA.
    """

    batch_invariant: bool | None = None

    def __init__(self, config: ModelConfig, in_dim: int | None = None):
        super().__init__()
        self.exact_nan = False
        in_dim = in_dim or config.hidden_size
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q_rows, kv_rows = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(in_dim, q_rows + 2 * kv_rows, bias=config.attention_bias)
        self.o_proj = Linear(q_rows, config.hidden_size, bias=config.o_proj_bias)
        _keep_published_keys(self, "qkv_proj", (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)))

    def forward(self, x: Tensor, li: LayerInputs, cache: KVCache, layer: int) -> Tensor:
        """Attend the new block ``x`` [B, T, in_dim] over the cache; writes its K/V rows. Returns [B, T, H]."""
        B, T, _ = x.shape
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        n_rep = nh // nkv
        qkv = self.qkv_proj(x)
        rope, kv = (li.cos, li.sin), (cache.k[layer], cache.v[layer])
        if (not self.exact_nan and self._invariant(qkv, kv[0])
                and attention_block_fits(qkv, rope, li.write_pos, kv, li.mask)):
            # the steps below in one call, with their bits
            return self.o_proj(attention_block(qkv, rope, li.write_pos, kv, li.mask, nh, D ** -0.5))
        qk, v = qkv.view(B, T, nh + 2 * nkv, D).split((nh + nkv, nkv), dim=2)
        q, k = apply_rope(qk, li.cos, li.sin).split((nh, nkv), dim=2)  # rope on q and k in one pass
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh|nkv, T, D)
        cache.write_rows(layer, li.row_index, k, v)
        mask = li.mask  # (B, 1, n_rep*T, S)
        S = mask.shape[-1]
        keys, values = cache.k[layer][:, :, :S], cache.v[layer][:, :, :S]  # (B, nkv, S, D)
        # GQA without copying the cache: fold the n_rep query heads of each kv head into the query axis
        q = q.reshape(B, nkv, n_rep * T, D)
        if self.exact_nan:
            keys, values, finite = _zero_nonfinite_rows(keys, values)
        if self._invariant(q, keys):
            out = invariant_attention(q, keys, values, mask, D ** -0.5)   # keys past S are never read
        else:
            if keys.dtype != q.dtype:  # a cache in another dtype than the model
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=li.bias)
        if self.exact_nan:
            # A query that can see a non-finite key/value row is NaN in exact arithmetic; one that
            # masks it is not (SDPA alone would leak it: masked weight 0 * NaN = NaN).
            sees_bad = (mask & ~finite[:, :, None, :]).any(-1, keepdim=True)  # (B, nkv, n_rep*T, 1)
            out = out.masked_fill(sees_bad, float("nan"))
        out = out.view(B, nh, T, D).transpose(1, 2).reshape(B, T, nh * D)
        return self.o_proj(out)

    def _invariant(self, q: Tensor, keys: Tensor) -> bool:
        """Whether this call takes the batch-invariant kernel (see the class docstring)."""
        return (self.batch_invariant is not False and q.is_cpu and q.dtype in cpu_gemm.KERNEL_DTYPES
                and keys.dtype in cpu_gemm.KERNEL_DTYPES and not torch.compiler.is_compiling()
                and not (q.requires_grad and torch.is_grad_enabled()) and cpu_gemm.available())


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one linear, ``gate_up_proj`` (fused at load time;
    checkpoints keep ``gate_proj``/``up_proj``).

    ``batch_invariant`` (None or True: on; ``set_batch_invariant``): on the CPU in float32 and bf16,
    eager and without autograd, ``silu(gate) * up`` is one C call element by element
    (``spec_decode.cpu.mlp``) where ``cpu_gemm.available()``, else ``_silu_per_element``: either way no
    element's bits depend on where a thread's share of the tensor ends.
    """

    batch_invariant: bool | None = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(H, 2 * I, bias=False)
        self.down_proj = Linear(I, H, bias=False)
        _keep_published_keys(self, "gate_up_proj", (("gate_proj", I), ("up_proj", I)))

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)                     # (B, T, 2I): [gate | up]
        if (self.batch_invariant is not False and x.is_cpu and x.dtype in cpu_gemm.KERNEL_DTYPES
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
            if gate_up.dtype is x.dtype and cpu_gemm.available():
                return self.down_proj(silu_mul(gate_up))   # the lines below in one call, element by element
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(_silu_per_element(gate) * up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _silu_per_element(x: Tensor) -> Tensor:
    """silu(x) = x / (1 + exp(-x)) in float32, rounded once to x's dtype. Shape: any -> same.

    ``F.silu`` on CPU computes a vector's worth of elements with one exp and the last few of a loop
    with another, which can differ in the last bit; with several threads a loop ends where the
    thread's share does, which follows the tensor's size, so an element's bits would follow the
    batch. ``exp``, the division and the add here compute every element the same way.
    NaN stays NaN.
    """
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf / torch.exp(-xf).add_(1)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``input_norm=False`` drops input_layernorm (EAGLE-1/2 layer 0)."""

    def __init__(self, config: ModelConfig, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, li: LayerInputs, cache: KVCache, layer: int) -> Tensor:
        weights = self._one_call_weights(x)
        if weights is not None:
            rope, kv = (li.cos, li.sin), (cache.k[layer], cache.v[layer])
            if _fits_once_a_forward(li, cache, x, weights, rope, kv):
                return decoder_layer(x, weights, rope, li.write_pos, kv, li.mask)   # the lines below, their bits
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, li, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _one_call_weights(self, x: Tensor) -> LayerWeights | None:
        """The layer's weights for ``spec_decode.cpu.layer.decoder_layer`` when every part of this call takes its
        batch-invariant C route (the norms', attention's and MLP's rules, each projection's
        ``invariant_panels``) and no forward hook watches a part; else None: the parts run one by one.

        A decode step passes here once a layer, so what was checked is kept (``_OneCall``) and, on later
        calls, only what can change is checked again: the parts, their hooks and switches, and the
        weights' versions."""
        if (torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu")
                or _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks or not x.is_cpu):
            return None
        kept = self.__dict__.get("_one_call")
        if kept is not None and kept.holds(self, x.dtype):
            return kept.weights
        kept = _OneCall.check(self, x)
        if kept is not None:
            self.__dict__["_one_call"] = kept
        return None if kept is None else kept.weights


class _OneCall:
    """What ``DecoderLayer._one_call_weights`` checked for one dtype: the parts it found, their packed
    projections and the ``LayerWeights`` over them."""

    __slots__ = ("dtype", "parts", "linears", "packed", "norm_weights", "weights")

    @staticmethod
    def _parts(layer: DecoderLayer) -> tuple:
        mods = layer._modules   # read directly: nn.Module's attribute lookup costs more than the rest
        attn, mlp = mods["self_attn"], mods["mlp"]
        return (attn, mlp, mods["post_attention_layernorm"], mods.get("input_layernorm"), attn._modules["qkv_proj"],
                attn._modules["o_proj"], mlp._modules["gate_up_proj"], mlp._modules["down_proj"])

    @classmethod
    def check(cls, layer: DecoderLayer, x: Tensor) -> "_OneCall | None":
        """Every part's own rule, in full; None where one says no."""
        parts = cls._parts(layer)
        attn, mlp, post, inp = parts[:4]
        norms = (post,) if inp is None else (post, inp)
        if (attn.exact_nan or attn.batch_invariant is False or mlp.batch_invariant is False
                or any(p is not None and (p._forward_hooks or p._forward_pre_hooks) for p in parts)
                or not all(n._invariant(x) and n.weight.is_contiguous() for n in norms)):
            return None
        panels = tuple(p.invariant_panels(x) for p in parts[4:])
        if None in panels or any(p.weight.is_inference() for p in parts[4:]):   # inference weights: packed anew
            return None
        kept = cls()
        kept.dtype, kept.parts, kept.linears = x.dtype, parts, parts[4:]
        kept.packed = tuple(p.kept_panels() for p in kept.linears)
        kept.norm_weights = tuple((n.weight, n.weight.data_ptr(), n.eps) for n in norms)
        kept.weights = LayerWeights((None if inp is None else inp.weight, post.weight),
                                    (0.0 if inp is None else inp.eps, post.eps),
                                    (attn.n_heads, attn.n_kv, attn.head_dim), panels)
        return kept

    def holds(self, layer: DecoderLayer, dtype: torch.dtype) -> bool:
        """Whether what ``check`` found still holds: the same parts, hooks and switches, each projection's packed
        copy still its weight's (``Linear`` repacks on a change), the same norm weights in the same storage (the
        kernel reads them in place, so a change of their values needs nothing)."""
        parts = self._parts(layer)
        attn, mlp, post, inp = parts[:4]
        return (dtype is self.dtype and all(a is b for a, b in zip(parts, self.parts))
                and not (attn.exact_nan or attn.batch_invariant is False or mlp.batch_invariant is False
                         or post.batch_invariant is False or (inp is not None and inp.batch_invariant is False))
                and not any(p is not None and (p._forward_hooks or p._forward_pre_hooks) for p in parts)
                and all(lin.invariant_panels_hold(dtype, packed) for lin, packed in zip(self.linears, self.packed))
                and all(n.weight is w and w.data_ptr() == ptr and n.eps == eps
                        for n, (w, ptr, eps) in zip((post, inp), self.norm_weights)))


def _fits_once_a_forward(li: LayerInputs, cache: KVCache, x: Tensor, weights: LayerWeights, rope, kv) -> bool:
    """``decoder_layer_fits`` for the first layer of a forward; the layers after it read the same rope, mask and
    cache tensors (slices of one K and one V), so its answer is kept on ``li`` for this cache and x's layout."""
    layout = (x.dtype, tuple(x.shape), weights.hidden)
    kept = li.__dict__.get("_one_call_fits")
    if kept is None or kept[0] is not cache.k or kept[1] is not cache.v or kept[2] != layout:
        fits = decoder_layer_fits(x, weights, rope, li.write_pos, kv, li.mask)
        kept = li.__dict__["_one_call_fits"] = (cache.k, cache.v, layout, fits)
    return kept[3] and x.is_contiguous()


def set_batch_invariant(module: nn.Module, on: bool | None) -> None:
    """Switch the batch-invariant CPU routes of every ``Linear``, ``Attention``, ``MLP`` and ``RMSNorm`` in
    ``module``.

    None (the default) or True: on where they run (the CPU, float32 and bf16, ``cpu_gemm.available()``);
    False: the fastest routes, whose bits may depend on the row count, ``kv_len`` and the batch.
    True where they cannot run (parameters off the CPU, float16, a CPU without the kernels) is a
    ValueError naming why: there is no batch-invariant route for it yet.
    """
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"batch_invariant must be True, False or None, got {on!r}")
    if on:
        blocker = batch_invariant_blocker(module)
        if blocker is not None:
            raise ValueError(f"batch_invariant=True: {blocker} (pass None or False)")
    set_invariant_linears(module, on)
    for m in module.modules():
        if isinstance(m, (Attention, MLP, RMSNorm)):
            m.batch_invariant = on


def batch_invariant_blocker(module: nn.Module) -> str | None:
    """Why ``module`` cannot take the batch-invariant routes, or None when it can (see ``set_batch_invariant``)."""
    params = list(module.parameters())
    devices = {p.device.type for p in params}
    if devices - {"cpu"}:
        return f"only CPU models have batch-invariant routes, this one is on {sorted(devices)}"
    dtypes = {p.dtype for p in params if p.is_floating_point()} - set(cpu_gemm.KERNEL_DTYPES)
    if dtypes:
        return f"the batch-invariant kernels take float32 and bfloat16, this model holds {sorted(map(str, dtypes))}"
    if not cpu_gemm.available():
        return KERNELS_MISSING
    return None


def batch_invariant_in_force(module: nn.Module) -> bool:
    """True when every projection and attention layer of ``module`` takes its batch-invariant route in eager
    inference: nothing blocks it (``batch_invariant_blocker``) and no layer was switched off."""
    layers = [m for m in module.modules() if isinstance(m, (Linear, Attention, MLP))]
    return (batch_invariant_blocker(module) is None
            and all(m.batch_invariant is not False and getattr(m, "panel", None) is not False for m in layers))


def ordinary_parameters(module: nn.Module) -> None:
    """Replace every parameter of ``module`` created under ``torch.inference_mode`` by an ordinary copy.

    Inference tensors keep no version counter, so a layer could not see an in-place change to a weight
    it packed; a model loaded under ``inference_mode`` would then lose its packed and batch-invariant
    routes. Tied parameters stay tied (one copy each); ordinary parameters are left alone.
    """
    copies: dict[int, nn.Parameter] = {}
    with torch.inference_mode(False):
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is not None and p.is_inference():
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.clone(), requires_grad=p.requires_grad)
                    m._parameters[name] = copies[id(p)]


def set_exact_nan(module: nn.Module, on: bool | None, dtype: torch.dtype) -> None:
    """Switch exact NaN propagation (see ``Attention``) in every attention layer of ``module``.

    ``on=None`` means the default: on for float16, off otherwise.
    """
    flag = dtype == torch.float16 if on is None else bool(on)
    for m in module.modules():
        if isinstance(m, Attention):
            m.exact_nan = flag
