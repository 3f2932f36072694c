"""Tests for spec_decode.cpu.linear: ``Linear``'s packed bf16, packed fp32 and panel routes against ``F.linear``,
their switches, and when each route is taken on each CPU class."""

from __future__ import annotations

import pytest
import torch

from spec_decode.cpu.capability import cpu_has_amx
from spec_decode.models import Transformer

from tiny_models import make_tiny_target


def _ids(B: int, T: int, V: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _packable_linear(out_f: int, in_f: int, bias: bool, seed: int = 0):
    from spec_decode.cpu import Linear

    torch.manual_seed(seed)
    lin = Linear(in_f, out_f, bias=bias).to(torch.bfloat16).requires_grad_(False)
    lin.weight.normal_()
    if bias:
        lin.bias.normal_()
    return lin


def _assert_matches_bf16_f_linear(got, x, lin):
    """``Linear``'s bf16 result against ``F.linear``'s: the same bits where oneDNN runs bf16 natively without
    AMX, on AMX on one row, or on one row without the panel kernel; elsewhere (a float32 copy of the
    weight, ``bf16_runs_as_fp32``; oneDNN's packed bf16 on AMX over two rows or more, whose kernels for
    the packed weight and for ``F.linear``'s need not sum alike) the same NaN/Inf places, at most one
    bf16 ulp apart, and equal on all but a few in 1,000 outputs."""
    import torch.nn.functional as F
    from spec_decode.cpu import onednn_bf16_native, panel_gemm_pays

    want = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(got.isnan(), want.isnan())
    one_row = x.numel() == x.shape[-1]
    if (onednn_bf16_native() and (one_row or not cpu_has_amx())) or (one_row and not panel_gemm_pays()):
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        return
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    g, w = got[finite].float(), want[finite].float()
    ulp = torch.maximum(g.abs(), w.abs()).clamp(min=1e-30).log2().floor().sub(7).exp2()
    assert bool(((g - w).abs() <= ulp).all())
    assert (g != w).sum().item() <= 3e-3 * g.numel()


def _bf16_paths(rows_seen) -> tuple[bool, bool]:
    """(float32 copy made, panels made) for a bf16 layer after calls over ``rows_seen`` rows, on this CPU:
    the panel kernel takes up to ``cpu_gemm.max_rows`` rows; without it one row keeps bf16 F.linear."""
    from spec_decode.cpu import cpu_gemm
    from spec_decode.cpu import bf16_runs_as_fp32, panel_gemm_pays

    if not bf16_runs_as_fp32():
        return False, False
    limit = cpu_gemm.max_rows(torch.get_num_threads()) if panel_gemm_pays() else 0
    return any(r > limit and r > 1 for r in rows_seen), any(r <= limit for r in rows_seen)


@pytest.mark.usefixtures("fast_routes")
@pytest.mark.parametrize("out_f,in_f", [(1, 1), (7, 3), (320, 192), (99, 989), (4096, 192)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_agrees_with_f_linear_on_every_cpu(out_f, in_f, bias):
    """Native oneDNN bf16 without AMX (avx512_bf16): the packed path gives F.linear's bits at every row
    count. With AMX (amx_bf16) it does on one row, and over two rows or more agrees to bf16 rounding (on
    a Xeon, 17 rows of [99, 989] put a few outputs one bf16 ulp off F.linear). Elsewhere, two rows or
    more run from a float32 copy of the weight (through the panel kernel where it runs, else packed when
    wide) and agree to bf16 rounding; one row keeps F.linear, or takes the panel kernel where it runs."""
    from spec_decode.cpu import onednn_bf16_native

    lin = _packable_linear(out_f, in_f, bias)
    for rows in (1, 2, 5, 17):
        x = torch.randn(2 if rows > 1 else 1, rows, in_f).to(torch.bfloat16)
        x[0, 0, 0] = float("nan")
        if in_f > 1:
            x[-1, -1, 1] = float("inf")
        with torch.inference_mode():
            got = lin(x)
        _assert_matches_bf16_f_linear(got, x, lin)
    one_row = torch.randn(1, 1, in_f).to(torch.bfloat16)   # finite: the one-row path's values are compared too
    with torch.inference_mode():
        _assert_matches_bf16_f_linear(lin(one_row), one_row, lin)
    copy, panel = _bf16_paths([1, 4, 10, 34, 1])
    assert ("_packed" in lin.__dict__) == (onednn_bf16_native() or (copy and out_f >= 2048))
    assert ("_panel" in lin.__dict__) == panel
    assert ("_fp32" in lin.__dict__) == copy


def test_bf16_as_fp32_path_is_a_wrong_answer_detector(monkeypatch):
    """The comparison above catches a path that skips the bias, or rounds the inputs an extra time.

    Its tolerant branch (the float32-copy path's) is forced, so the detector runs on every CPU."""
    import torch.nn.functional as F
    from spec_decode.cpu import linear as model

    monkeypatch.setattr(model, "onednn_bf16_native", lambda: False)
    lin = _packable_linear(320, 192, True)
    x = torch.randn(2, 5, 192).to(torch.bfloat16)
    _assert_matches_bf16_f_linear(F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16),
                                  x, lin)   # the float32-copy path's own answer passes
    no_bias = F.linear(x.float(), lin.weight.float()).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        _assert_matches_bf16_f_linear(no_bias, x, lin)
    double_round = F.linear(x.float(), lin.weight.float()).to(torch.float16).to(torch.bfloat16) + lin.bias
    with pytest.raises(AssertionError):
        _assert_matches_bf16_f_linear(double_round, x, lin)


@pytest.mark.usefixtures("fast_routes")
def test_packed_linear_follows_in_place_weight_changes_and_its_switch():
    import torch.nn.functional as F
    from spec_decode.cpu import onednn_bf16_native, set_packed_linears

    lin = _packable_linear(64, 48, True)
    x = torch.randn(1, 3, 48).to(torch.bfloat16)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2)   # in place: the packed (or float32) copy must not serve the old weight
    with torch.inference_mode():
        after = lin(x)
    assert not torch.equal(before, after)
    _assert_matches_bf16_f_linear(after, x, lin)
    with torch.no_grad():
        lin.bias.add_(100)    # the float32 copy of the bias follows too
    with torch.inference_mode():
        _assert_matches_bf16_f_linear(lin(x), x, lin)
    lin.weight = torch.nn.Parameter(torch.randn(64, 48).to(torch.bfloat16), requires_grad=False)  # replaced
    with torch.inference_mode():
        _assert_matches_bf16_f_linear(lin(x), x, lin)
    assert ("_packed" in lin.__dict__) == onednn_bf16_native()
    assert (("_fp32" in lin.__dict__), ("_panel" in lin.__dict__)) == _bf16_paths([3])
    set_packed_linears(lin, False)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert "_packed" not in lin.__dict__ and "_fp32" not in lin.__dict__ and "_panel" not in lin.__dict__


@pytest.mark.usefixtures("fast_routes")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_leaves_grad_mode_and_other_dtypes_to_f_linear(dtype):
    """Training needs autograd, which the packed op does not have; narrow fp32 linears are never packed."""
    lin = _packable_linear(16, 8, True).to(dtype).requires_grad_(True)
    x = torch.randn(2, 8).to(dtype)
    lin(x).sum().backward()
    assert lin.weight.grad is not None
    assert "_packed" not in lin.__dict__ and "_fp32" not in lin.__dict__
    with torch.inference_mode():
        lin(x)
    from spec_decode.cpu import onednn_bf16_native
    assert ("_packed" in lin.__dict__) == (dtype == torch.bfloat16 and onednn_bf16_native())
    if dtype == torch.bfloat16:
        assert ("_fp32" in lin.__dict__) == _bf16_paths([2])[0]


def test_linear_leaves_autocast_to_f_linear():
    """Under autocast F.linear casts the operands itself; a packed or float32 path would bypass it."""
    import torch.nn.functional as F

    lin = _packable_linear(4096, 64, True).float()
    x = torch.randn(5, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = lin(x)
        want = F.linear(x, lin.weight, lin.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert "_packed" not in lin.__dict__ and "_fp32" not in lin.__dict__


@pytest.mark.usefixtures("fast_routes")
def test_packed_linears_leave_a_bf16_forward_as_f_linear_computes_it(tmp_path):
    """Bit-identical where oneDNN runs bf16; elsewhere (float32 copies) equal to bf16 rounding."""
    from spec_decode.cpu import Linear, onednn_bf16_native, set_packed_linears

    model = Transformer.from_pretrained(make_tiny_target(tmp_path), dtype=torch.bfloat16)
    outs = []
    for on in (False, None):
        set_packed_linears(model, on)
        with torch.inference_mode():
            cache = model.new_cache(2, 24)
            first = model(_ids(2, 9), cache, kv_len=9).logits
            cache.commit(torch.tensor([9, 9]))
            outs.append((first, model(_ids(2, 3, seed=1), cache, kv_len=12).logits))
    for a, b in zip(*outs):
        if onednn_bf16_native():
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 4 + 1
    assert all(("_packed" in m.__dict__) == onednn_bf16_native() for m in linears if m.out_features < 2048)
    copy, panel = _bf16_paths([18, 6])
    assert all(("_fp32" in m.__dict__) == copy and ("_panel" in m.__dict__) == panel for m in linears)


_AVX512_CASES = [(1024, 2, True), (1024, 5, True), (4096, 1, True), (3072, 1, True),
                 (1024, 1, False), (2048, 1, False), (1023, 8, False), (320, 5, False)]
_AVX2_CASES = [(2048, 2, True), (4096, 5, True), (4096, 17, True),
               (4096, 1, False), (2047, 8, False), (1024, 5, False), (320, 5, False)]


@pytest.mark.usefixtures("fast_routes")
@pytest.mark.parametrize("avx512,out_f,rows,packs", [(True, *c) for c in _AVX512_CASES] + [(False, *c) for c in _AVX2_CASES])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_fp32_linears_are_packed_per_cpu_class_and_agree_with_f_linear(avx512, out_f, rows, packs, bias):
    """fp32 takes oneDNN's packed path only for wide projections (``fp32_packs``), with thresholds of its own
    on AVX-512 and on AVX2 CPUs; on AVX2 the panel kernel serves these row counts first. Either agrees
    with F.linear to fp32 rounding, and NaN/Inf land in the same places. The layer itself runs here for
    this CPU's class."""
    import torch.nn.functional as F
    from spec_decode.cpu import fp32_packs, onednn_fp32_packing_pays, panel_gemm_pays

    assert fp32_packs(out_f, rows, avx512=avx512) is packs
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512") != avx512:
        return   # the other class's thresholds: checked above, not run on this CPU
    in_f = 192
    lin = _packable_linear(out_f, in_f, bias).float()
    x = torch.randn(1, rows, in_f)
    x[0, 0, 3] = float("nan")           # row 0 all NaN
    if rows > 1:
        x[0, 1, 5] = float("inf")       # row 1: +-Inf and NaN (Inf - Inf)
    with torch.inference_mode():
        got = lin(x)
    want = F.linear(x, lin.weight, lin.bias)
    assert ("_packed" in lin.__dict__) == (packs and onednn_fp32_packing_pays() and not panel_gemm_pays())
    assert ("_panel" in lin.__dict__) == panel_gemm_pays()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


def test_packed_fp32_linear_follows_in_place_weight_changes():
    """A stale packed fp32 weight would serve the old projection: caught by comparing with F.linear."""
    import torch.nn.functional as F

    lin = _packable_linear(1024, 48, True).float()
    x = torch.randn(1, 5, 48)
    with torch.inference_mode():
        before = lin(x)
    with torch.no_grad():
        lin.weight.mul_(-2)
    with torch.inference_mode():
        after = lin(x)
    torch.testing.assert_close(after, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(before, after)
    with torch.no_grad():
        lin.bias.add_(100)    # the panel kernel keeps a padded copy of the bias: it must follow too
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("fast_routes")
def test_the_panel_switch_restores_the_other_rules():
    """``set_panel_linears(m, False)`` drops the kernel's copy and takes the rules it overrides again."""
    import torch.nn.functional as F
    from spec_decode.cpu import fp32_packs, onednn_fp32_packing_pays, panel_gemm_pays, set_panel_linears

    lin = _packable_linear(4096, 64, True).float()
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        on = lin(x)
    assert ("_panel" in lin.__dict__) == panel_gemm_pays()
    set_panel_linears(lin, False)
    with torch.inference_mode():
        off = lin(x)
    assert "_panel" not in lin.__dict__
    assert ("_packed" in lin.__dict__) == (fp32_packs(4096, 5) and onednn_fp32_packing_pays())
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(off, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
    set_panel_linears(lin, None)
    with torch.inference_mode():
        assert torch.equal(lin(x), on)


def test_bf16_layers_keep_bf16_panels_with_the_bits_of_float32_ones():
    """A bf16 layer's panels stay bf16 (half the bytes); ``panel_dtype=torch.float32`` packs them in float32,
    with the same outputs bit for bit (bf16 -> float32 is exact)."""
    from spec_decode.cpu import panel_gemm_pays, set_panel_linears

    if not panel_gemm_pays():
        pytest.skip("Linear never routes to the panel kernel on this CPU (AVX-512, or no kernel: panel_gemm_pays)")
    lin = _packable_linear(320, 192, True).to(torch.bfloat16)
    x = torch.randn(1, 5, 192).to(torch.bfloat16)
    with torch.inference_mode():
        bf16_panels = lin(x)
    assert lin.__dict__["_panel"][1].panels.dtype == torch.bfloat16
    set_panel_linears(lin, None, panel_dtype=torch.float32)
    with torch.inference_mode():
        f32_panels = lin(x)
    assert lin.__dict__["_panel"][1].panels.dtype == torch.float32
    assert torch.equal(bf16_panels.view(torch.int16), f32_panels.view(torch.int16))
    with pytest.raises(ValueError, match="panel_dtype must be None or torch.float32"):
        set_panel_linears(lin, None, panel_dtype=torch.bfloat16)


@pytest.mark.usefixtures("fast_routes")
@pytest.mark.parametrize("threads,rows,panel", [(1, 128, True), (1, 129, False), (2, 16, True), (2, 17, False)])
def test_the_panel_kernel_takes_few_rows_and_more_on_one_thread(threads, rows, panel):
    """It runs on one thread: MKL on two threads ties at 16 rows and wins from 32 (``cpu_gemm.max_rows``)."""
    import torch.nn.functional as F
    from spec_decode.cpu import panel_gemm_pays

    lin = _packable_linear(64, 32, True).float()
    x = torch.randn(rows, 32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = lin(x)
    finally:
        torch.set_num_threads(before)
    assert ("_panel" in lin.__dict__) == (panel and panel_gemm_pays())
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:safespec. a Linear's weights were created under torch.inference_mode")
@pytest.mark.parametrize("invariant", [None, False])
def test_weights_made_under_inference_mode_are_never_kept_packed(invariant):
    """They keep no version counter, so no packed copy is kept and an in-place change is always seen: the
    batch-invariant route packs them on every call (the kernel's bits), the other routes leave them to
    F.linear."""
    import torch.nn.functional as F
    from spec_decode.cpu import cpu_gemm, set_invariant_linears

    if invariant is None and not cpu_gemm.available():
        pytest.skip("the batch-invariant route needs cpu_gemm")
    with torch.inference_mode():
        lin = _packable_linear(32, 16, False)
        lin32 = _packable_linear(32, 16, False).float()
        for layer in (lin, lin32):
            set_invariant_linears(layer, invariant)
        x, x32 = torch.randn(1, 2, 16).to(torch.bfloat16), torch.randn(1, 2, 16)
        for layer, inp in ((lin, x), (lin32, x32)):
            layer(inp)
            layer.weight.mul_(3)
            want = cpu_gemm.PanelWeight(layer.weight)(inp) if invariant is None else F.linear(inp, layer.weight)
            assert torch.equal(layer(inp), want)
    assert all(k not in layer.__dict__ for layer in (lin, lin32) for k in ("_packed", "_panel", "_fp32"))
