"""Qwen2-VL / Qwen2.5-VL (engine/model/vision/qwen2_vl.py; its positions mrope.py's, test_mrope.py): the tower and
processor against transformers' vision model (both versions), and 2.5 served by the engine's runner: greedy tokens
and chosen-token log-probs against transformers' generate() with the same images, a row's bits alone and batched
with other image and text rows, prefilled whole or in chunks, a prefix-cache hit, legacy checkpoints."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.vision.qwen2_vl import QWEN2_VL, QwenVLProcessor, window_order
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.helpers import make_engine
from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, MERGE, draw_image

CPU = torch.device("cpu")
N = 6
IMAGES = [draw_image(40, 24, 1), draw_image(30, 44, 2), draw_image(16, 16, 3)]


@pytest.fixture(scope="module")
def tiny(qwen2_5_vl_checkpoint):
    """The tiny Qwen2.5-VL's HF model, our runner (the default backend: the fused C++ stack) and processor
    (Qwen2-VL's tower is test_qwen2_vl_tower's, its language model the same)."""
    path, hf = qwen2_5_vl_checkpoint
    runner = ModelRunner(path, torch.float32, CPU, block_size=4, num_blocks=160)
    return hf, runner, QWEN2_VL.load_processor(path)


def _prompt(processor, images, text: str = "Describe"):
    marks = " and ".join(QWEN2_VL.image_placeholder(processor) for _ in images)
    return QWEN2_VL.prepare(processor, f"{text} {marks} now.", images, add_special_tokens=True)


def generate(runner: ModelRunner, prompts: list, n: int, chunk: int | None = None):
    """Greedy-decode MultimodalPrompts (or token lists) together for n tokens, prefilling `chunk` tokens a step
    (None: whole); returns (tokens, the float32 logits each token was drawn from) per prompt."""
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    seqs = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt.token_ids) if hasattr(prompt, "token_ids") else list(prompt)
        params = SamplingParams(multimodal=prompt if hasattr(prompt, "token_ids") else None)
        seq = Sequence(f"r{i}", ids, params)
        seq.block_table = allocator.allocate(num_blocks_needed(len(ids) + n, runner.block_size))
        seqs.append(seq)
    logits = [[] for _ in seqs]
    while active := [s for s in seqs if s.num_output_tokens < n]:
        counts = [min(chunk or s.num_tokens, s.num_tokens - s.num_computed_tokens) for s in active]
        out = runner.execute(runner.prepare(SchedulerOutput(seqs=active, num_scheduled_tokens=counts)))
        for row, (seq, count) in enumerate(zip(active, counts)):
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:
                logits[seqs.index(seq)].append(out.logits[row].clone())
                seq.output_token_ids.append(int(out.logits[row].argmax()))     # sync: the test's host loop
    return [s.output_token_ids for s in seqs], [torch.stack(rows) for rows in logits]


def hf_generate(hf, prompt, n: int):
    """transformers' greedy tokens and each step's raw logits for the prompt's ids, pixels and grids."""
    ids = torch.tensor([prompt.token_ids])
    out = hf.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
        pixel_values=torch.cat([image.pixel_inputs["pixel_values"] for image in prompt.images]),
        image_grid_thw=torch.cat([image.pixel_inputs["image_grid_thw"] for image in prompt.images]),
        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.cat(out.logits).float()


@pytest.mark.parametrize("count", [1, 2])
def test_greedy_tokens_and_their_log_probs_equal_transformers_generate(tiny, count):
    hf, runner, processor = tiny
    prompt = _prompt(processor, IMAGES[:count])
    (ours,), (our_logits,) = generate(runner, [prompt], N)
    theirs, their_logits = hf_generate(hf, prompt, N)
    assert ours == theirs
    chosen = torch.tensor(ours)[:, None]
    torch.testing.assert_close(torch.log_softmax(our_logits, -1).gather(1, chosen),
                               torch.log_softmax(their_logits, -1).gather(1, chosen), rtol=0, atol=2e-5)
    other = _prompt(processor, IMAGES[2:3] + IMAGES[1:count])        # another first picture: other logits
    assert not torch.allclose(generate(runner, [other], 1)[1][0], our_logits[:1], atol=1e-3)


def test_a_row_s_bits_are_the_same_alone_and_batched_with_image_and_text_rows_whole_or_chunked(tiny):
    _, runner, processor = tiny
    target = _prompt(processor, IMAGES[:2])
    (alone,), (alone_logits,) = generate(runner, [target], N)
    others = [_prompt(processor, IMAGES[2:], "Other"), [1, 17, 300, 45, 9], _prompt(processor, IMAGES[1:2], "x")]
    for chunk in (None, 5):
        tokens, logits = generate(runner, [others[0], target, others[1], others[2]], N, chunk)
        assert tokens[1] == alone and torch.equal(logits[1], alone_logits), f"chunk {chunk}"


def test_a_prefix_cache_hit_past_the_image_gives_the_tokens_of_a_miss_in_16_token_steps(qwen2_5_vl_checkpoint, tiny):
    """The engine (scheduler, prefix cache, chunked prefill): a request whose cached prefix ends past its image
    resumes on the image prompt's streams (M-RoPE positions at a start inside the prompt)."""
    _, _, processor = tiny
    engine = make_engine(qwen2_5_vl_checkpoint[0], processor.tokenizer, max_num_batched_tokens=16)
    prompt = _prompt(processor, IMAGES[:2])
    params = SamplingParams(max_new_tokens=N, ignore_eos=True, multimodal=prompt)

    def run(request_id: str):
        seq = engine.add_request(request_id, list(prompt.token_ids), params)
        tokens = []
        while engine.has_unfinished:
            tokens += [(t.id, t.log_prob) for out in engine.step() for t in out.new_tokens]
        return seq, tokens

    miss, first = run("a")
    hit, second = run("b")
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens > prompt.images[-1].end
    assert second == first and [t for t, _ in first] == generate(tiny[1], [prompt], N)[0][0]


def test_a_flat_legacy_config_and_language_model_tensor_names_load_to_the_same_bits(tiny, qwen2_5_vl_checkpoint,
                                                                                   tmp_path):
    """Qwen's hub checkpoints: config.json with the text keys at the top and rope_scaling {"type": "mrope"}; the
    tensors as transformers 4.5x saved them (model.language_model.*, model.visual.*)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path = qwen2_5_vl_checkpoint[0]
    for name in path.iterdir():
        if name.name not in ("config.json", "model.safetensors"):
            shutil.copy(name, tmp_path / name.name)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**{k: v for k, v in text.items() if k != "model_type"}, **cfg, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): t for k, t in load_file(path / "model.safetensors").items()}
    save_file(renamed, tmp_path / "model.safetensors")
    legacy = ModelRunner(tmp_path, torch.float32, CPU, block_size=4, num_blocks=64)
    prompt = _prompt(tiny[2], IMAGES[:2])
    assert torch.equal(generate(legacy, [prompt], 2)[1][0], generate(tiny[1], [prompt], 2)[1][0])


# ---- the tower and the processor, Qwen2-VL and Qwen2.5-VL ----------------------------------------------------

@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def towers(request):
    path, hf = request.getfixturevalue(f"{request.param}_checkpoint")
    encoder = QWEN2_VL.load_encoder(path, read_config(path), torch.float32, CPU)
    return path, hf, encoder, QwenVLProcessor.load(path)


def test_the_processor_expands_each_image_to_its_merged_tokens_between_the_vision_tokens(towers):
    _, _, _, processor = towers
    prompt = _prompt(processor, IMAGES[:2])
    grids = [image.pixel_inputs["image_grid_thw"][0].tolist() for image in prompt.images]
    assert grids == [[1, 6, 10], [1, 12, 8]]
    for image, (t, h, w) in zip(prompt.images, grids):
        assert image.num_tokens == t * h * w // MERGE ** 2
        assert image.pixel_inputs["pixel_values"].shape == (t * h * w, 3 * 2 * 4 * 4)
        assert all(prompt.token_ids[p] == IMAGE_TOKEN_ID for p in image.positions())
    assert sum(t == IMAGE_TOKEN_ID for t in prompt.token_ids) == sum(i.num_tokens for i in prompt.images)
    with pytest.raises(ValueError, match="2 images but 1"):
        processor("one " + processor.image_token, IMAGES[:2])


def test_the_checkpoint_s_chat_template_writes_one_placeholder_per_image_part(towers):
    from jinja2 import Template

    _, _, _, processor = towers
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = Template(processor.chat_template).render(messages=messages, add_generation_prompt=True)
    assert text.count(QWEN2_VL.image_placeholder(processor)) == 2
    assert len(QWEN2_VL.prepare(processor, text, IMAGES[:2], add_special_tokens=False).images) == 2


@pytest.mark.parametrize("count", [1, 2])
def test_the_tower_gives_transformers_vision_model_s_tokens(towers, count):
    """Each image encoded alone (as the engine does) against transformers' visual over the prompt's images at once
    (its attention never crosses an image)."""
    _, hf, encoder, processor = towers
    prompt = _prompt(processor, IMAGES[:count])
    ours = torch.cat([encoder.encode(image) for image in prompt.images])
    pixels = torch.cat([image.pixel_inputs["pixel_values"] for image in prompt.images])
    grids = torch.cat([image.pixel_inputs["image_grid_thw"] for image in prompt.images])
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=grids).pooler_output
    assert ours.shape == (sum(image.num_tokens for image in prompt.images), 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_qwen2_5_windows_cut_the_merged_grid_from_its_top_left_as_transformers_does():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 10, 6), (1, 8, 8), (2, 4, 12)]
    order, bounds = window_order(grids, MERGE, 2)
    index, cu = get_vision_window_index(torch.tensor(grids), MERGE, 16, 4)
    assert torch.equal(order, index)
    assert [a for a, _ in bounds] + [bounds[-1][1]] == cu.tolist()


def test_the_decode_graphs_take_generated_tokens_but_not_a_prompt_row_at_three_streams(tiny):
    """A one-row step inside the image prompt (its last token after a prefix-cache hit) has (3, 1) positions: the
    graphs' (T,) buffers cannot hold it, it runs eager; a generated token's position is p + delta, (T,)."""
    from tests.engine.graph_helpers import decode_graphs

    _, runner, processor = tiny
    prompt = _prompt(processor, IMAGES[:1])
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    seq = Sequence("r", list(prompt.token_ids), SamplingParams(multimodal=prompt))
    seq.block_table = allocator.allocate(num_blocks_needed(seq.num_tokens + 2, runner.block_size))
    graphs = decode_graphs(runner, max_num_seqs=2)
    seq.num_computed_tokens = seq.num_prompt_tokens - 1
    last = runner.prepare(SchedulerOutput(seqs=[seq], num_scheduled_tokens=[1]))
    assert last.positions.shape == (3, 1) and not graphs.takes(last)
    seq.output_token_ids.append(7)
    seq.num_computed_tokens = seq.num_prompt_tokens
    step = runner.prepare(SchedulerOutput(seqs=[seq], num_scheduled_tokens=[1]))
    streams = runner.mrope.streams(prompt)
    assert step.positions.tolist() == [seq.num_prompt_tokens + streams.delta] and graphs.takes(step)
