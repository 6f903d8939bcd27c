"""Shared fixtures: the prepared demo model (run `lmi-handler prepare-model` or `make test`)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from tests.helpers import MODEL_DIR, mt_bench_questions

# Property tests draw the same examples every run: a CI failure is reproducible, never a coin toss.
settings.register_profile("lmi_handler", derandomize=True, print_blob=True)
settings.load_profile("lmi_handler")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail("the demo model is not prepared: run `make test` or `lmi-handler prepare-model`")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    """First turns of the MT-Bench questions (benchmarks/data), in file order."""
    return mt_bench_questions()
