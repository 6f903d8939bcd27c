"""The step a CUDA graph records (engine/cuda_graphs.py), on option.kernel_backend=triton, run eagerly over its
static buffers with a padding row: bitwise the unpadded step's logits, and the padding row writes nothing to
the KV cache (under Triton's interpreter here; compiled on a GPU). Capture and replay need CUDA."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.graph_helpers import assert_padded_step_equals_unpadded
from tests.engine.helpers import build_tiny_llama

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")


def test_the_triton_graph_step_with_padding_equals_the_unpadded_step(tmp_path, device):
    build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    runner = ModelRunner(tmp_path, torch.float32, device, block_size=4, num_blocks=32, kernel_backend="triton")
    assert runner.model.ops is tb and runner.graphs is None      # enforce_eager by default when built directly
    assert_padded_step_equals_unpadded(runner, BlockAllocator(runner.num_blocks, runner.block_size))
