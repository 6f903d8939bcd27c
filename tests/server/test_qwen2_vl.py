"""The openai client's image message to a tiny random Qwen2.5-VL served by the real app in this process: the
checkpoint's own chat template and processor (vision/qwen2_vl.py), M-RoPE in the engine, answered as transformers'
generate() answers the same picture (docs/images.md)."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from jinja2 import Template

from lmi_handler.engine.model.vision.qwen2_vl import QWEN2_VL
from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, draw_image
from tests.engine.vision_models import data_url

pytestmark = pytest.mark.slow         # the app starts (about 5 s on a quiet host)
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def qwen_app(qwen2_5_vl_checkpoint):
    from tests.server.helpers import InProcessServer

    server = InProcessServer(model_id=str(qwen2_5_vl_checkpoint[0]), dtype="fp32", num_threads="1",
                             kv_cache_bytes=str(16 << 20))
    yield server
    server.close()


def test_the_openai_clients_image_message_is_answered_as_transformers_generates_it(qwen_app, qwen2_5_vl_checkpoint):
    path, hf = qwen2_5_vl_checkpoint
    images = [draw_image(40, 24, 5), draw_image(24, 32, 6)]
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=qwen_app.app)))
    reply = qwen_app.loop.run_until_complete(sdk.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}],
        temperature=0, max_tokens=6, logprobs=True))
    processor = QWEN2_VL.load_processor(path)
    text = Template(processor.chat_template).render(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}], add_generation_prompt=True)
    prompt = QWEN2_VL.prepare(processor, text, images, add_special_tokens=False)
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
            pixel_values=torch.cat([image.pixel_inputs["pixel_values"] for image in prompt.images]),
            image_grid_thw=torch.cat([image.pixel_inputs["image_grid_thw"] for image in prompt.images]),
            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True)
    expected = out.sequences[0, ids.shape[1]:].tolist()
    expected_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, expected)]
    assert reply.usage.prompt_tokens == ids.shape[1] and reply.usage.completion_tokens == 6
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(expected_lp, abs=1e-4)
