"""Shared fixtures (fixtures only; helpers live in helpers.py modules): the prepared demo model (run
`lmi-handler prepare-model` or `make test`), a Service and batch runner on it, and the real servers the HTTP,
case and batch tests share. Every server starts on first use and stops at the end of its scope."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from hypothesis import settings

from tests.batch.helpers import RayHead, start
from tests.helpers import MODEL_DIR, REPO, SMALL_KV_CACHE_BYTES, mt_bench_questions, serve

# Property tests draw the same examples every run: a CI failure is reproducible, never a coin toss.
settings.register_profile("lmi_handler", derandomize=True, print_blob=True)
settings.load_profile("lmi_handler")


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (`make test` runs the fast suite so: a test "
                          "that needs another to have run first fails there)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()


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


@pytest.fixture(scope="session")
def service(model_dir):
    """The demo model's Service in this process, on the repo's serving.properties."""
    from lmi_handler.config import Settings, read_serving_properties
    from lmi_handler.service import Service

    properties = read_serving_properties(REPO / "serving.properties", environ={})
    return Service(Settings.from_properties(properties))


@pytest.fixture(scope="session")
def runner(service):
    from lmi_handler.batch.runner import BatchRunner

    return BatchRunner(service)


@pytest.fixture(scope="session")
def app(model_dir):
    """The real app in this process (ASGI, no sockets): its own model, two served names, 4 sequences a step, a
    256 MiB KV cache (it lives as long as the session, beside the other in-process models)."""
    from tests.server.helpers import InProcessServer

    server = InProcessServer(max_rolling_batch_size="4", num_threads="1", served_model_name="smol, model",
                             kv_cache_bytes=str(SMALL_KV_CACHE_BYTES))
    yield server
    server.close()


@pytest.fixture(scope="session")
def rolling_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "rolling", max_rolling_batch_size="16")


@pytest.fixture(scope="session")
def dynamic_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "dynamic", rolling_batch="disable")


@pytest.fixture(scope="session")
def fp32_server(model_dir, tmp_path_factory):
    """The demo model in float32 (option.dtype=fp32), as transformers runs it on the CPU: the token routes'
    and lm-evaluation-harness's tests compare its log probs with transformers' own."""
    yield from serve(tmp_path_factory, "fp32", dtype="fp32", max_rolling_batch_size="8")


@pytest.fixture(scope="module")
def tgi_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "tgi", tgi_compat="true")


@pytest.fixture(scope="module")
def sse_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "sse", output_formatter="sse")


@pytest.fixture(scope="session")
def client(rolling_server):
    with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
        yield http


@pytest.fixture(scope="session")
def batch_server(model_dir, tmp_path_factory):
    """A server for the Batch API: its state in a fresh directory, 1 thread, a 200 kB upload limit."""
    with start(tmp_path_factory, tmp_path_factory.mktemp("batches"), "batch-api") as running:
        yield running


@pytest.fixture(scope="session")
def batch_sdk(batch_server):
    import openai

    return openai.OpenAI(base_url=batch_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 with 2 CPUs for one test module (batch/cluster.py's --address path)."""
    cluster = RayHead(tmp_path_factory.mktemp("ray") / "head.log")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """A tiny random Idefics3 (SmolVLM) checkpoint with its processor (tests/engine/vision_models.py): (its
    directory, transformers' model, its processor)."""
    from tests.engine.vision_models import build_tiny_idefics3

    path = tmp_path_factory.mktemp("tiny_vlm")
    model, processor = build_tiny_idefics3(path)
    return path, model, processor


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """A tiny random LLaVA-1.5 checkpoint with its processor: (its directory, transformers' model, its processor)."""
    from tests.engine.vision_models import build_tiny_llava

    path = tmp_path_factory.mktemp("tiny_llava")
    model, processor = build_tiny_llava(path)
    return path, model, processor


@pytest.fixture(scope="session")
def qwen2_5_vl_checkpoint(tmp_path_factory):
    """(model_dir, hf_model): the tiny Qwen2.5-VL with its processor (qwen2_vl_models.py), built once."""
    from tests.engine.qwen2_vl_models import build_tiny_processor, build_tiny_qwen2_vl

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = build_tiny_qwen2_vl(path, "qwen2_5_vl")
    build_tiny_processor(path)
    return path, hf


@pytest.fixture(scope="session")
def qwen2_vl_checkpoint(tmp_path_factory):
    """(model_dir, hf_model): the tiny Qwen2-VL with its processor, built once."""
    from tests.engine.qwen2_vl_models import build_tiny_processor, build_tiny_qwen2_vl

    path = tmp_path_factory.mktemp("qwen2_vl")
    hf = build_tiny_qwen2_vl(path, "qwen2_vl")
    build_tiny_processor(path)
    return path, hf
