"""The Triton kernel tests run on CUDA tensors where a GPU is present, else on CPU tensors under Triton's
interpreter: TRITON_INTERPRET=1 is set here, before any kernel module is imported (the backend imports them on
first use, so the variable is read when the kernels are defined)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when a GPU runs the kernels compiled, cpu under the interpreter."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda")
    return torch.device("cpu")
