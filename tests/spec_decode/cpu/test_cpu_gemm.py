"""Tests for spec_decode.cpu.cpu_gemm: the AVX2 panel kernel against its pure-torch reference, bit for bit.

The reference (``reference_panel_linear``) emulates the kernel's k-ordered float32 FMAs exactly, so
the two must agree on every bit over odd shapes, with and without a bias, and with NaN/Inf placed
in the input, the weight and the bias. Against ``F.linear`` (another summation order) they agree
to float32 rounding.
"""
from __future__ import annotations

import ctypes
import platform
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from spec_decode.cpu import cpu_gemm
from spec_decode.cpu.cpu_gemm import PanelWeight, reference_panel_linear

X86_AVX2 = (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")))
HAS_CC = shutil.which(cpu_gemm._compiler()[0]) is not None
pytestmark = pytest.mark.skipif(not (X86_AVX2 and HAS_CC),
                                reason="the panel kernel needs an x86-64 CPU with AVX2 and a C compiler")

SHAPES = [(1, 1, 1), (1, 192, 5), (2, 3, 16), (3, 7, 17), (5, 192, 320), (6, 33, 40), (7, 65, 31),
          (13, 19, 100), (4, 512, 48),
          # blocks of 1, 2, 3 and 4 rows over many octets (8, 5, 3 and 2 octets a call, calls that
          # straddle two panels, then single octets up to a partial last one); several blocks of rows:
          # 8 rows as 6 + 2, 13 as 6 + 6 + 1, a prefill's 100 (its last block of 4); and the prefetch's
          # last panel
          (1, 40, 203), (2, 24, 467), (3, 19, 407), (8, 24, 467), (13, 19, 407), (100, 33, 300)]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits, NaN included (any NaN payload counts as the same NaN)."""
    return (got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32)))


def _operands(M, K, N, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


def test_the_kernel_builds_and_loads_on_this_cpu():
    assert cpu_gemm.available()


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_its_reference_bit_for_bit(M, K, N, bias):
    x, w, b = _operands(M, K, N, bias)
    got = PanelWeight(w, b)(x)
    assert _same_bits(got, reference_panel_linear(x, w, b))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,K,N", [(3, 7, 17), (6, 33, 40), (13, 19, 100)])
def test_nan_and_inf_land_where_the_reference_puts_them(M, K, N):
    x, w, b = _operands(M, K, N, True, seed=1)
    x[0, 0] = float("nan")                 # row 0: NaN everywhere
    x[1, K - 1] = float("inf")             # row 1: +-Inf, NaN where a weight is 0
    w[N - 1, 0] = float("-inf")            # the last column: -+Inf on every row
    w[N // 2, 1 % K] = float("nan")        # a NaN column
    w[N // 3, K - 1] = 0.0
    b[N // 4] = float("inf")               # an Inf bias
    got = PanelWeight(w, b)(x)
    want = reference_panel_linear(x, w, b)
    assert _same_bits(got, want)
    f = F.linear(x, w, b)
    assert torch.equal(got.isnan(), f.isnan()) and torch.equal(got.isinf(), f.isinf())
    assert got.isnan().any() and got.isinf().any()


def test_magnitudes_that_make_float64_round_twice():
    """Wide magnitude ranges make the float64 sum inexact; the reference must still match the FMA."""
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        x = torch.randn(3, 5, generator=g) * torch.exp2(torch.randint(-30, 30, (3, 5), generator=g).float())
        w = torch.randn(17, 5, generator=g) * torch.exp2(torch.randint(-30, 30, (17, 5), generator=g).float())
        assert _same_bits(PanelWeight(w)(x), reference_panel_linear(x, w))


def test_a_double_rounding_case_is_emulated_exactly():
    """fma(1 + 2^-23, (1 - 2^-23) 2^-24, 1 + 2^-23): the float64 sum lands halfway between two float32
    values, so rounding it again gives 1 + 2^-22, where the single rounding of an FMA gives 1 + 2^-23."""
    x = torch.tensor([[1 + 2 ** -23]])
    w = torch.tensor([[(1 - 2 ** -23) * 2 ** -24]])
    b = torch.tensor([1 + 2 ** -23])
    twice = (b.double() + x.double() * w.double()).float()
    assert twice.item() == 1 + 2 ** -22                         # the naive emulation is wrong here
    assert reference_panel_linear(x, w, b).item() == 1 + 2 ** -23
    assert PanelWeight(w, b)(x).item() == 1 + 2 ** -23


def test_the_overflow_threshold_rounds_by_the_exact_sum():
    """A float64 sum exactly on float32's overflow threshold rounds to Inf unless the exact sum is inside."""
    threshold = torch.tensor([cpu_gemm._OVERFLOW_THRESHOLD], dtype=torch.float64)
    fma = cpu_gemm.fma_f32
    assert fma(threshold, torch.tensor([0.0])).item() == float("inf")                # exact: a tie, to Inf
    assert fma(threshold, torch.tensor([-(2.0 ** 40)])).item() == torch.finfo(torch.float32).max
    assert fma(-threshold, torch.tensor([2.0 ** 40])).item() == -torch.finfo(torch.float32).max
    assert fma(threshold, torch.tensor([2.0 ** 40])).item() == float("inf")


@pytest.mark.parametrize("M", [2, 5, 6, 7, 13, 64])
def test_a_row_gets_the_same_bits_alone_or_in_a_block(M):
    """Batch invariance: each output sums in k order whatever the row count."""
    x, w, b = _operands(M, 192, 320, True, seed=3)
    packed = PanelWeight(w, b)
    block = packed(x)
    for m in (0, M // 2, M - 1):
        assert _same_bits(packed(x[m:m + 1]), block[m:m + 1])


def test_inputs_of_any_leading_shape_and_layout():
    x, w, b = _operands(10, 24, 40, True, seed=4)
    packed = PanelWeight(w, b)
    want = packed(x)
    assert _same_bits(packed(x.view(2, 5, 24)), want.view(2, 5, 40))
    assert _same_bits(packed(x.view(1, 2, 5, 24)), want.view(1, 2, 5, 40))
    strided = torch.randn(24, 10).t()                            # not contiguous
    assert _same_bits(packed(strided), reference_panel_linear(strided.contiguous(), w, b))
    assert packed(x[:0]).shape == (0, 40)


def test_bad_arguments_are_named():
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match="weight must be a float32 or bfloat16"):
        PanelWeight(w.double())
    with pytest.raises(ValueError, match="weight must be a float32 or bfloat16"):
        PanelWeight(w.half())
    with pytest.raises(ValueError, match="weight must be a float32"):
        PanelWeight(w[0])
    with pytest.raises(ValueError, match=r"bias must be a float32 or bfloat16 CPU tensor \[16\]"):
        PanelWeight(w, torch.randn(15))
    with pytest.raises(ValueError, match=r"bias must be a float32 or bfloat16 CPU tensor \[16\]"):
        PanelWeight(w, torch.randn(16).double())
    packed = PanelWeight(w)
    with pytest.raises(ValueError, match=r"x must be a float32 or bfloat16 CPU tensor \[\.\.\., 8\]"):
        packed(torch.randn(2, 9))
    with pytest.raises(ValueError, match="x must be a float32 or bfloat16"):
        packed(torch.randn(2, 8).double())
    with pytest.raises(ValueError, match="x must be a float32 or bfloat16"):
        packed(torch.tensor(1.0))
    with pytest.raises(ValueError, match="x requires grad"):
        packed(torch.randn(2, 8, requires_grad=True))


def test_the_packed_copy_does_not_follow_the_weight():
    """``PanelWeight`` is a snapshot; ``Linear`` rebuilds it when its weight changes (test_linear)."""
    x, w, b = _operands(2, 8, 16, True, seed=5)
    packed = PanelWeight(w, b)
    before = packed(x)
    w.mul_(2)
    assert _same_bits(packed(x), before)


@pytest.fixture
def fresh_kernel():
    """Forget the loaded kernel (and ``Linear``'s CPU rule) before and after the test."""
    from spec_decode.cpu import capability as model

    def clear():
        cpu_gemm.loaded_kernels.cache_clear()
        model.panel_gemm_pays.cache_clear()

    clear()
    yield
    clear()


def test_a_failed_build_warns_and_linear_falls_back(monkeypatch, tmp_path, fresh_kernel):
    from spec_decode.cpu import Linear, capability

    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="panel kernel could not be built"):
        assert not cpu_gemm.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # one warning, not one per call
        assert not cpu_gemm.available()
    with pytest.raises(RuntimeError, match="not available"):
        PanelWeight(torch.randn(16, 8))
    lin = Linear(8, 16).requires_grad_(False)
    x = torch.randn(3, 8)
    monkeypatch.setattr(capability, "INVARIANCE_OFF_WARNED", set())   # once a process: this test's own
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="batch-invariant routes are off.*cpu_gemm"):
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert "_panel" not in lin.__dict__


def test_a_broken_compiler_is_reported_with_its_message(monkeypatch, tmp_path, fresh_kernel):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: fatal error: no input' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    with pytest.warns(RuntimeWarning, match="fatal error: no input"):
        assert not cpu_gemm.available()
    assert not list((tmp_path / "cache").glob("*.so*"))       # no half-written library left behind


def test_the_switch_turns_the_kernel_off(monkeypatch, fresh_kernel):
    monkeypatch.setenv("SAFESPEC_PANEL_GEMM", "0")
    assert not cpu_gemm.available()


@pytest.mark.slow
def test_a_build_is_reused_from_the_cache(monkeypatch, tmp_path, fresh_kernel):
    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path))
    assert cpu_gemm.available()
    built = list(tmp_path.glob("cpu_gemm-*.so"))
    assert len(built) == 1
    cpu_gemm.loaded_kernels.cache_clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError("rebuilt although the cache holds the library")

    monkeypatch.setattr(cpu_gemm.subprocess, "run", no_compiler)
    assert cpu_gemm.available()


@pytest.mark.slow
def test_a_new_build_prunes_all_but_the_most_recently_used_ones(monkeypatch, tmp_path, fresh_kernel):
    import os

    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path))
    old = [tmp_path / f"cpu_gemm-old{i}.so" for i in range(6)]
    for i, path in enumerate(old):
        path.write_bytes(b"stale")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))   # old5 the most recently used
    other = tmp_path / "unrelated.so"
    other.write_bytes(b"not ours")
    assert cpu_gemm.available()
    kept = sorted(p.name for p in tmp_path.glob("cpu_gemm-*.so"))
    assert len(kept) == cpu_gemm._KEEP_BUILDS
    assert {"cpu_gemm-old5.so", "cpu_gemm-old4.so", "cpu_gemm-old3.so"} <= set(kept)
    assert other.exists()
    built = [p for p in kept if not p.startswith("cpu_gemm-old")]
    assert len(built) == 1


@pytest.mark.slow
def test_an_unwritable_default_cache_falls_back_to_a_temporary_directory_silently(monkeypatch, tmp_path,
                                                                                  fresh_kernel):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.delenv("SAFESPEC_CACHE", raising=False)
    monkeypatch.delenv("SAFESPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))   # a read-only home, as it were
    monkeypatch.setattr(cpu_gemm.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_gemm.available()
    assert list((tmp_path / "tmp").glob("safespec-*/cpu_gemm-*.so"))


# ------------------------------------------------------------------ the cache ($SAFESPEC_CACHE, spec_decode.disk_cache)
def _fake_compiler(tmp_path) -> str:
    """A C compiler that writes an empty file where ``-o`` says (the cache's paths, without compiling)."""
    cc = tmp_path / "fake-cc"
    cc.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cc.chmod(0o755)
    return str(cc)


def _not_loadable_warning(record) -> None:
    assert any(w.category is RuntimeWarning and "could not be built" in str(w.message) for w in record)


def test_an_unusable_cache_variable_is_named_and_the_build_falls_back(monkeypatch, tmp_path, fresh_kernel):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("SAFESPEC_CACHE", str(blocked))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path))
    monkeypatch.setattr(cpu_gemm.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu_gemm.available()
    assert any(w.category is RuntimeWarning and "($SAFESPEC_CACHE): a file is there" in str(w.message)
               and "set $SAFESPEC_CACHE to a directory you can write" in str(w.message) for w in record)
    assert list((tmp_path / "tmp").glob("safespec-*/cpu_gemm-*.so"))


def test_the_older_variable_still_names_the_kernels_cache(monkeypatch, tmp_path, fresh_kernel):
    monkeypatch.delenv("SAFESPEC_CACHE", raising=False)
    monkeypatch.setenv("SAFESPEC_CACHE_DIR", str(tmp_path / "legacy"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu_gemm.available()
    assert any(w.category is DeprecationWarning and "SAFESPEC_CACHE_DIR is deprecated" in str(w.message)
               for w in record)
    _not_loadable_warning(record)
    assert list((tmp_path / "legacy").glob("cpu_gemm-*.so"))


def test_a_killed_builds_temporary_is_removed_by_the_next_build(monkeypatch, tmp_path, fresh_kernel):
    import os
    import subprocess
    import sys

    from spec_decode import disk_cache

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = disk_cache.temporary_name("cpu_gemm").split(".")[2]
    left = tmp_path / f".cpu_gemm-tmp.{host}.{dead}.0badcafe.so"
    left.write_bytes(b"half a library")
    live = tmp_path / disk_cache.temporary_name("cpu_gemm", ".so")   # this process's: a build under way
    live.write_bytes(b"being written")
    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cpu_gemm.available()
    _not_loadable_warning(record)
    assert not left.exists() and live.exists()


@pytest.mark.slow
def test_the_kernel_is_built_into_safespec_cache_with_the_users_umask(monkeypatch, tmp_path, fresh_kernel):
    import os
    import stat

    monkeypatch.setenv("SAFESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SAFESPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o022)
    try:
        assert cpu_gemm.available()
    finally:
        os.umask(old)
    built = list((tmp_path / "cache").glob("cpu_gemm-*.so"))
    assert len(built) == 1 and not (tmp_path / "xdg").exists()
    assert stat.S_IMODE(built[0].stat().st_mode) & 0o044 == 0o044   # the others sharing the cache can load it


@pytest.mark.parametrize("M,K,N", [(1, 192, 5), (3, 7, 17), (7, 65, 31), (13, 19, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_inputs_round_the_float32_result_once(M, K, N, bias):
    """bf16 in, bf16 out: the float32 kernel on the exact upcast, rounded to nearest even as torch does."""
    x, w, b = _operands(M, K, N, bias, seed=6)
    xb = x.to(torch.bfloat16)
    xb[0, 0] = float("nan")
    xb[-1, -1] = float("inf")
    got = PanelWeight(w, b)(xb)
    want = reference_panel_linear(xb.float(), w, b).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))


def test_bf16_rounding_ties_go_to_even():
    """1 + 2^-8 lies halfway between two bf16 values: it rounds to 1 (even); 1 + 3 * 2^-8 to 1 + 2^-6."""
    w = torch.eye(16)
    x = torch.zeros(1, 16).to(torch.bfloat16)
    x[0, 0], x[0, 1] = 1.0, 2 ** -7
    packed = PanelWeight(w, torch.tensor([2 ** -8] * 2 + [0.0] * 14))
    y = packed(x)
    assert y[0, 0].item() == 1.0                      # 1 + 2^-8: a tie, to the even 1.0
    assert y[0, 1].item() == 2 ** -7 + 2 ** -8        # exact in bf16, kept
    assert torch.equal(y.float(), (x.float() + packed.bias[:16]).to(torch.bfloat16).float())


def _bf16_weight_case(M, K, N, bias, seed):
    """bf16 weight and bias with NaN/Inf in x, the weight and the bias."""
    x, w, b = _operands(M, K, N, bias, seed=seed)
    w = w.to(torch.bfloat16)
    w[0, -1], w[-1, 0] = float("nan"), float("-inf")
    x[-1, K // 2] = float("inf")
    if bias:
        b = b.to(torch.bfloat16)
        b[-1] = float("nan")
    return x, w, b


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_give_the_bits_of_their_float32_values(M, K, N, bias):
    """bf16 panels (half the bytes) load as float32 exactly: the same bits as the float32 weight, and as
    the reference, NaN/Inf included; for float32 and bf16 x alike."""
    x, w, b = _bf16_weight_case(M, K, N, bias, seed=8)
    packed = PanelWeight(w, b)
    assert packed.panels.dtype == torch.bfloat16
    w32, b32 = w.float(), None if b is None else b.float()
    got = packed(x)
    assert got.dtype == torch.float32
    assert _same_bits(got, reference_panel_linear(x, w, b))
    assert _same_bits(got, PanelWeight(w32, b32)(x))
    xb = x.to(torch.bfloat16)
    got16, want16 = packed(xb), PanelWeight(w32, b32)(xb)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16.isnan(), want16.isnan())
    assert torch.equal(got16.nan_to_num(0.0).view(torch.int16), want16.nan_to_num(0.0).view(torch.int16))


def test_a_wrong_bf16_load_would_be_caught():
    """The bf16 case above fails for a kernel that read the panels' bits as truncated or shifted values:
    flipping the lowest bf16 mantissa bit of one weight changes the output bits."""
    x, w, _ = _operands(3, 40, 33, False, seed=9)
    w = w.to(torch.bfloat16)
    nudged = w.clone()
    nudged.view(torch.int16)[5, 7] ^= 1
    assert not _same_bits(PanelWeight(w)(x), PanelWeight(nudged)(x))


# ------------------------------------------------------------------ the AVX2 and AVX-512F paths: the same bits
@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """Force one path of the projection kernel (skipped where the CPU lacks it); the best one again after."""
    if cpu_gemm.set_isa(request.param) != request.param:
        cpu_gemm.set_isa(None)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    cpu_gemm.set_isa(None)


def test_the_best_path_is_chosen_and_each_can_be_forced():
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n", 1)[0].split()
    best = "avx512" if "avx512f" in flags else "avx2"
    try:
        assert cpu_gemm.set_isa(None) == cpu_gemm.isa() == best
        assert cpu_gemm.set_isa("avx2") == cpu_gemm.isa() == "avx2"
        assert cpu_gemm.set_isa("avx512") == best
    finally:
        cpu_gemm.set_isa(None)
    with pytest.raises(ValueError, match="isa"):
        cpu_gemm.set_isa("sse")


def _special_values(x, w, b):
    """NaN/Inf in x, the weight and the bias, at the first, a middle and the last k, row and column (a NaN
    row and a -Inf row only where there are rows to spare for them)."""
    M, K = x.shape
    N = w.shape[0]
    if M >= 2:
        x[0, 0] = float("nan")
    if M >= 3:
        x[M // 2, K // 2] = float("-inf")
    x[M - 1, K - 1] = float("inf")
    w[N - 1, 0] = float("-inf")
    w[N // 2, K - 1] = float("nan")
    w[0, K // 3] = float("inf")
    w[N // 3, K - 1] = 0.0                  # Inf * 0 on the last row: NaN from the last k
    if b is not None:
        b[N // 4] = float("inf")
        b[N - 1] = float("nan")


PATH_SHAPES = [(1, 1), (3, 7), (7, 17), (33, 40), (19, 100), (65, 31), (24, 467), (40, 113)]


@pytest.mark.parametrize("M", range(1, 18))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_each_path_equals_the_reference_and_the_other_path(M, wdtype, isa):
    """Every row count 1..17 (blocks of every size and their remainders), odd K and N (zero-padded last
    panels, a panel count that fills no call), with and without bias, float32 and bf16 weights, float32
    and bf16 x, NaN/Inf in place: the forced path gives the reference's bits and the AVX2 path's."""
    seen_nan = seen_inf = False
    for i, (K, N) in enumerate(PATH_SHAPES):
        bias = i % 2 == 1
        x, w, b = _operands(M, K, N, bias, seed=100 + M * 13 + i)
        w = w.to(wdtype)
        if b is not None:
            b = b.to(wdtype)
        _special_values(x, w, b)
        packed = PanelWeight(w, b)
        got, got16 = packed(x), packed(x.to(torch.bfloat16))
        assert _same_bits(got, reference_panel_linear(x, w, b)), (K, N)
        cpu_gemm.set_isa("avx2")
        try:
            want, want16 = packed(x), packed(x.to(torch.bfloat16))
        finally:
            cpu_gemm.set_isa(isa)
        assert _same_bits(got, want), (K, N)
        assert torch.equal(got16.isnan(), want16.isnan()), (K, N)
        assert torch.equal(got16.nan_to_num(0.0).view(torch.int16), want16.nan_to_num(0.0).view(torch.int16)), (K, N)
        seen_nan, seen_inf = seen_nan or bool(got.isnan().any()), seen_inf or bool(got.isinf().any())
    assert seen_nan and seen_inf


@pytest.mark.parametrize("M", [2, 6, 9, 13, 17])
def test_a_row_gets_the_same_bits_alone_or_in_a_block_on_each_path(M, isa):
    x, w, b = _operands(M, 150, 300, True, seed=7)
    packed = PanelWeight(w.to(torch.bfloat16), b)
    block = packed(x)
    for r in range(M):
        assert _same_bits(block[r:r + 1], packed(x[r:r + 1]))


def test_the_fma_peak_is_measured_on_the_path_asked_for():
    if not cpu_gemm.available():
        pytest.skip("the panel kernel is not available on this machine")
    avx2 = cpu_gemm.fma_peak_gflops("avx2", steps=20_000, repeats=2)
    assert avx2 > 0
    with pytest.raises(ValueError, match="isa_name must be one of"):
        cpu_gemm.fma_peak_gflops("sse")
    # 16 lanes where the CPU has AVX-512F: the kernel says which lanes it ran
    sink = ctypes.c_float()
    lanes = cpu_gemm.loaded_kernels().fma_peak(cpu_gemm.ISAS["avx512"], 10, ctypes.byref(sink))
    assert lanes == (16 if cpu_gemm.set_isa("avx512") == "avx512" else 8)
    cpu_gemm.set_isa(None)


def test_runnable_isas_lists_this_cpus_paths_and_keeps_the_one_in_use():
    if not cpu_gemm.available():
        assert cpu_gemm.runnable_isas() == ()
        return
    avx512 = cpu_gemm.set_isa("avx512") == "avx512"
    try:
        cpu_gemm.set_isa("avx2")   # forced, as a measurement of the AVX2 path on an AVX-512 CPU does
        assert cpu_gemm.runnable_isas() == (("avx2", "avx512") if avx512 else ("avx2",))
        assert cpu_gemm.isa() == "avx2"
    finally:
        cpu_gemm.set_isa(None)
