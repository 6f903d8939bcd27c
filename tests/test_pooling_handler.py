"""handle() of a pooling model driven as DJL's front end drives it (DESIGN §2): rolling and dynamic batch."""
from __future__ import annotations

import json

import pytest

from lmi_handler import handler
from lmi_handler.djl import OwnInput, PairList, binary_decode
from tests.engine.pooling_models import build_encoder, write_sentence_transformers, write_wordpiece_tokenizer


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedder")
    build_encoder(path, "bert")
    write_wordpiece_tokenizer(path)
    write_sentence_transformers(path, "mean", normalize=True)
    return path


def _worker(path, **options) -> handler.Handler:
    worker = handler.Handler()
    props = {"model_id": str(path), "task": "text-embedding", "device_id": "-1", "cluster_size": 1,
             "handler": "handle", **options}
    assert worker.handle(OwnInput(props)) is None
    return worker


def _call(bodies: list[bytes], rolling: bool) -> OwnInput:
    props, content = {"batch_size": str(len(bodies))}, PairList()
    for i, body in enumerate(bodies):
        content.add(f"batch_{i:03d}.data", body)
        if rolling:
            props[f"batch_{i:03d}.requestId"] = f"r{i}"
            props[f"batch_{i:03d}.Content-Type"] = "application/json"
    return OwnInput(props, content)


GOOD, BAD = json.dumps({"inputs": ["cats sleep", "hello world"]}).encode(), json.dumps({"inputs": 7}).encode()


def test_rolling_handle_answers_every_item_in_its_first_step_and_a_bad_one_alone_with_its_code(embedder_dir):
    worker = _worker(embedder_dir)
    output = worker.handle(_call([GOOD, BAD, GOOD], rolling=True))
    entries = [binary_decode(output.content.value_at(i)) for i in range(3)]
    assert [e["last"] for e in entries] == ["true"] * 3 and [e["request_id"] for e in entries] == ["r0", "r1", "r2"]
    vectors = json.loads(entries[0]["data"])
    assert len(vectors) == 2 and len(vectors[0]) == 32 and json.loads(entries[2]["data"]) == vectors
    assert entries[1]["code"] == "400" and "inputs" in entries[1]["error"] and entries[1]["data"] == ""


def test_dynamic_handle_answers_each_item_under_its_index(embedder_dir):
    worker = _worker(embedder_dir, rolling_batch="disable")
    output = worker.handle(_call([GOOD, BAD], rolling=False))
    first, second = (json.loads(output.content.value_at(i)) for i in range(2))
    assert len(first) == 2 and second["code"] == 400 and output.properties["batch_1_code"] == "400"


def test_task_auto_serves_generation_for_a_generative_checkpoint_and_embeddings_for_a_sentence_transformer(
        embedder_dir, tmp_path):
    from lmi_handler.config import Settings
    from lmi_handler.pooling_service import served_task

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert served_task(Settings.from_properties({"model_id": str(tmp_path), "task": "auto"})) == "text-generation"
    assert served_task(Settings.from_properties({"model_id": str(embedder_dir), "task": "auto"})) == "text-embedding"
