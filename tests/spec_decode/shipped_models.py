"""The shipped tiny target and EAGLE head as module-scoped fixtures, for test modules that import them
(``from shipped_models import PROMPT, eagle, needs_fixtures, target``)."""
from __future__ import annotations

import pytest
import torch

from spec_decode.fixtures import EAGLE_SUBDIR, TARGET_SUBDIR, find_fixtures_dir
from spec_decode.models import Transformer
from spec_decode.models.eagle import load_drafter

FX = find_fixtures_dir()
needs_fixtures = pytest.mark.skipif(FX is None or not (FX / TARGET_SUBDIR).is_dir(), reason="no shipped fixtures")
PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def target():
    return Transformer.from_pretrained(FX / TARGET_SUBDIR, dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle(target):
    return load_drafter(FX / EAGLE_SUBDIR, target, method="eagle")
