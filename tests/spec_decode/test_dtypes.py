"""spec_decode.dtypes (the one short-name -> torch dtype map) and spec_decode.fixtures (the one lookup)."""

from __future__ import annotations

import pytest
import torch

from spec_decode.dtypes import DTYPE_NAMES, DTYPES, torch_dtype
from spec_decode.fixtures import FIXTURES_ENV, find_fixtures_dir


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_names_map_to_torch_dtypes(name, dtype):
    assert torch_dtype(name) is dtype and DTYPES[name] is dtype


@pytest.mark.parametrize("bad", ["fp8", "float32", "", None, 16])
def test_unknown_name_is_a_value_error_listing_the_names(bad):
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        torch_dtype(bad)


def test_every_user_of_dtype_names_reads_this_map():
    """The bench, the numerics bench and the pytest plugin hold no table of their own."""
    from spec_decode.integrations import pytest_plugin
    from spec_decode.bench import methods, numerics_bench

    assert set(DTYPE_NAMES) == set(pytest_plugin.DTYPE_NAMES)
    assert all(pytest_plugin._torch_dtype(n) is DTYPES[n] for n in pytest_plugin.DTYPE_NAMES)
    assert all(numerics_bench.DTYPES[n] is DTYPES[n] for n in numerics_bench.DTYPES)
    assert not hasattr(methods, "DTYPES")


def test_find_fixtures_dir_walks_up_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(FIXTURES_ENV, raising=False)
    (tmp_path / "fixtures" / "models").mkdir(parents=True)
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert find_fixtures_dir(deep) == (tmp_path / "fixtures").resolve()
    monkeypatch.setenv(FIXTURES_ENV, str(tmp_path / "elsewhere"))
    assert find_fixtures_dir(deep) == tmp_path / "elsewhere"   # returned as given, so callers can name it


def test_bench_and_plugin_share_the_lookup(monkeypatch, tmp_path):
    from spec_decode.integrations import pytest_plugin
    from spec_decode.bench.config import default_fixtures_dir

    assert pytest_plugin.find_fixtures_dir is find_fixtures_dir
    monkeypatch.setenv(FIXTURES_ENV, str(tmp_path))
    assert default_fixtures_dir() == tmp_path
