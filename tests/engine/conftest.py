"""Engine test fixtures: tiny random Llama checkpoints and a tiny tokenizer (helpers.py builds them)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.helpers import TINY_VARIANTS, build_tiny_llama, build_tiny_tokenizer


@pytest.fixture(scope="session", params=sorted(TINY_VARIANTS))
def tiny_model(request, tmp_path_factory):
    """(model_dir, hf_model) for each tiny variant."""
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return path, build_tiny_llama(path, **TINY_VARIANTS[request.param])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """One tiny GQA checkpoint with tied embeddings, for tests that need just one."""
    path = tmp_path_factory.mktemp("tiny_default")
    build_tiny_llama(path, **TINY_VARIANTS["gqa_tied"])
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()

