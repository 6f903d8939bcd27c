"""M-RoPE (Qwen2.5-VL's three position streams) on option.kernel_backend=triton (under Triton's interpreter on CPU
tensors here): the rotary rows are built before the ops, so the rope kernel takes them as any rows; an image
prompt's streams give transformers' language model's logits, and three equal streams the one stream's bits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model.mrope import mrope_positions
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.helpers import make_meta
from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, MERGE, VISION_END_ID, VISION_START_ID

pytestmark = [pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)"),
              pytest.mark.slow]

GRID = (1, 4, 6)                           # 6 merged tokens on a 2 x 3 grid
IDS = [1, 11, VISION_START_ID] + [IMAGE_TOKEN_ID] * 6 + [VISION_END_ID, 5, 6]


def _logits(runner: ModelRunner, positions: torch.Tensor, device) -> torch.Tensor:
    meta = make_meta([list(range(4))], [0], [len(IDS)], 4)
    meta = dataclasses.replace(meta, **{f: getattr(meta, f).to(device) for f in
                                        ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q")})
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(IDS, device=device), positions.to(device), runner.kv_caches, meta)
        return runner.model.compute_logits(hidden).cpu()


def test_image_streams_on_triton_give_the_language_model_s_logits_and_equal_streams_one_stream_s_bits(
        qwen2_5_vl_checkpoint, device):
    path, hf = qwen2_5_vl_checkpoint
    runner = ModelRunner(path, torch.float32, device, block_size=4, num_blocks=16, kernel_backend="triton")
    assert runner.model.ops is tb
    streams = mrope_positions(len(IDS), [(3, GRID)], MERGE).prompt
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([IDS]), position_ids=streams[:, None, :]).logits[0]
    torch.testing.assert_close(_logits(runner, streams, device), theirs, rtol=1e-5, atol=1e-5)
    index = torch.arange(len(IDS))
    assert torch.equal(_logits(runner, index, device), _logits(runner, index.expand(3, -1), device))
