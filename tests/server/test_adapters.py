"""LoRA on the real app (in process, a tiny random Llama, httpx and the openai SDK): the adapter APIs (LMI's
management routes and vLLM's), the listings, bad adapters, and requests naming an adapter by every way a
client can (answered by that adapter: transformers' tokens with it merged; 404 for one not loaded; 400 with
LoRA off; 501 under tensor parallelism, which does not apply them)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer
from tests.engine.lora_helpers import merge_adapter, write_peft_adapter
from tests.server.helpers import fresh_server

GREEDY = {"max_new_tokens": 6, "ignore_eos": True, "do_sample": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny model folder `tiny` with adapters/alpha (LMI's start-up folder) and a run-time root `runtime`
    holding adapters beta and gamma, and one of rank 32."""
    root = tmp_path_factory.mktemp("lora_app")
    model = build_tiny_llama(root / "tiny", tie_word_embeddings=False)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(root / "tiny")
    merge_adapter(model, write_peft_adapter(root / "tiny" / "adapters" / "alpha", model.config, seed=1), 2.0)
    torch.save(model.state_dict(), root / "alpha_merged.pt")    # transformers' model with alpha merged (fp32)
    for seed, name in enumerate(("beta", "gamma")):
        write_peft_adapter(root / "runtime" / name, model.config, seed=2 + seed)
    write_peft_adapter(root / "runtime" / "wide", model.config, rank=32)
    write_peft_adapter(root / "elsewhere" / "delta", model.config)
    return root


def _options(root, **extra) -> dict[str, str]:
    return {"model_id": str(root / "tiny"), "enable_lora": "true", "lora_adapter_roots": str(root / "runtime"),
            "max_cpu_loras": "4", "num_threads": "1", **extra}


def _delete(server, path: str, **kwargs) -> httpx.Response:
    return server.loop.run_until_complete(server.client.request("DELETE", path, **kwargs))


def _names(server) -> list[str]:
    return [a["name"] for a in server.get("/models/tiny/adapters").json()["adapters"]]


def test_adapters_load_list_and_unload_through_both_apis(tiny_dir):
    with fresh_server(**_options(tiny_dir)) as server:
        assert _names(server) == ["alpha"]                           # <model>/adapters/alpha at start-up
        loaded = server.post("/models/tiny/adapters", params={"name": "beta", "src": str(tiny_dir / "runtime/beta")})
        assert loaded.status_code == 200 and loaded.json() == {"status": "Adapter beta registered"}
        vllm = server.post("/v1/load_lora_adapter", json={"lora_name": "gamma",
                                                          "lora_path": str(tiny_dir / "runtime/gamma")})
        assert vllm.status_code == 200 and "gamma" in vllm.text
        assert _names(server) == ["alpha", "beta", "gamma"]
        card = server.get("/models/tiny/adapters/beta").json()
        assert card["rank"] == 8 and card["scale"] == 2.0 and "q_proj" in card["modules"]
        models = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
        assert models["tiny"].get("parent") is None
        assert {models[n]["parent"] for n in ("alpha", "beta", "gamma")} == {"tiny"}
        assert server.get("/models").json()["models"][0]["adapters"] == ["alpha", "beta", "gamma"]
        metrics = server.get("/metrics").text
        assert "lmi_lora_adapters_loaded 3.0" in metrics and "lmi_lora_adapters_max 4.0" in metrics
        assert _delete(server, "/models/tiny/adapters/beta").json() == {"status": "Adapter beta unregistered"}
        assert server.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
        assert _names(server) == ["alpha"]
        gone = server.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert gone.status_code == 404 and "'gamma' is not loaded" in gone.json()["error"]["message"]
        assert gone.json()["error"]["param"] == "lora_name"


BAD_SOURCES = [("runtime/wide", 400, "rank 32, over option.max_lora_rank=16"),
               ("elsewhere/delta", 400, "outside the allowed roots"),
               ("runtime/missing", 400, "has no adapter_config.json"),
               ("tiny/adapters/alpha", 409, "already loaded")]


def test_a_bad_adapter_answers_its_4xx_naming_the_problem_and_changes_nothing(tiny_dir):
    with fresh_server(**_options(tiny_dir, lora_adapter_roots=f"{tiny_dir / 'runtime'},{tiny_dir / 'tiny'}")) as server:
        for src, status, message in BAD_SOURCES:
            name = "alpha" if status == 409 else "new"
            lmi = server.post("/models/tiny/adapters", params={"name": name, "src": str(tiny_dir / src)})
            assert lmi.status_code == status and message in lmi.json()["error"], lmi.text
            vllm = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tiny_dir / src)})
            assert vllm.status_code == status and message in vllm.json()["error"]["message"]
            assert vllm.json()["error"]["param"] == ("lora_name" if status == 409 else "lora_path")   # vLLM's fields
            assert _names(server) == ["alpha"]
        assert server.post("/v1/load_lora_adapter", json={"lora_name": "x"}).json()["error"]["param"] == "lora_path"
        assert server.post("/models/nope/adapters", params={"name": "x", "src": "y"}).status_code == 404


def _merged_greedy(tiny_dir, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model with adapter alpha merged (argmax; never stops at eos)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir / "tiny").eval()
    model.load_state_dict(torch.load(tiny_dir / "alpha_merged.pt"))
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def _invoke(server, body: dict, **kwargs) -> dict:
    response = server.post("/invocations", json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def test_requests_naming_an_adapter_are_answered_by_it_through_every_way_a_client_names_one(tiny_dir):
    """/invocations `adapters`, the SageMaker header, TGI's adapter_id, the openai SDK's model=<adapter> and a
    batch file's line all give adapter alpha's answer: transformers' greedy tokens with alpha merged. A base
    request in the same step gives the base's answer; a name not loaded is 404 in the route's shape."""
    from openai import AsyncOpenAI

    with fresh_server(**_options(tiny_dir, batch_dir=str(tiny_dir / "batches"))) as server:
        body = {"inputs": "hello", "parameters": {**GREEDY, "details": True, "decoder_input_details": True}}
        base_alone = _invoke(server, body)
        adapter, base = server.gather(server.client.post("/invocations", json={**body, "adapters": "alpha"}),
                                      server.client.post("/invocations", json=body))
        adapter, base = adapter.json(), base.json()
        prompt_ids = [t["id"] for t in adapter["details"]["prefill"]]
        assert [t["id"] for t in adapter["details"]["tokens"]] == _merged_greedy(tiny_dir, prompt_ids, 6)
        assert base == base_alone and base["generated_text"] != adapter["generated_text"]
        text = adapter["generated_text"]
        plain = {"inputs": "hello", "parameters": GREEDY}
        assert _invoke(server, plain, headers={"X-Amzn-SageMaker-Adapter-Identifier": "alpha"})["generated_text"] == text
        tgi = server.post("/generate", json={"inputs": "hello", "parameters": {**GREEDY, "adapter_id": "alpha"}})
        assert tgi.status_code == 200 and tgi.json()["generated_text"] == text
        unknown = server.post("/invocations", json={**plain, "adapters": "nope"})
        assert unknown.status_code == 404 and unknown.json() == {
            "error": "The adapter `nope` does not exist (loaded adapters: alpha)", "code": 404}
        header = server.post("/invocations", json=plain, headers={"X-Amzn-SageMaker-Adapter-Identifier": "nope"})
        assert header.status_code == 404 and "`nope`" in header.json()["error"]
        bad = server.post("/invocations", json={**plain, "adapters": ["alpha", "alpha"]})
        assert bad.status_code == 400 and "adapters" in bad.json()["error"]
        line = {"model": "alpha", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}

        async def sdk():
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://app/v1")
            client = AsyncOpenAI(api_key="none", base_url="http://app/v1", http_client=http, max_retries=0)
            completion = await client.completions.create(model="alpha", prompt="hello", max_tokens=6, temperature=0,
                                                         extra_body={"ignore_eos": True})
            models = await client.models.list()
            upload = await client.files.create(file=("lines.jsonl", json.dumps(
                {"custom_id": "one", "method": "POST", "url": "/v1/completions", "body": line}).encode()),
                purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                completion_window="24h")
            for _ in range(600):
                batch = await client.batches.retrieve(batch.id)
                if batch.status in ("completed", "failed", "cancelled", "expired"):
                    break
                await asyncio.sleep(0.05)
            records = (await client.files.content(batch.output_file_id)).text if batch.output_file_id else ""
            await http.aclose()
            return completion, [m.id for m in models.data], batch.status, records

        completion, ids, status, records = server.loop.run_until_complete(sdk())
        assert completion.choices[0].text == text and completion.model == "alpha" and ids == ["tiny", "alpha"]
        assert status == "completed", records
        record = json.loads(records.splitlines()[0])["response"]["body"]
        assert record["choices"][0]["text"] == text and record["model"] == "alpha"


def test_with_lora_off_adapter_requests_and_routes_answer_400(tiny_dir):
    with fresh_server(model_id=str(tiny_dir / "tiny"), num_threads="1") as server:
        refused = server.post("/invocations", json={"inputs": "hi", "adapters": "alpha"})
        assert refused.status_code == 400 and "option.enable_lora=false" in refused.json()["error"]
        tgi = server.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "alpha"}})
        assert tgi.status_code == 400 and "option.enable_lora=false" in tgi.text
        load = server.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tiny_dir)})
        assert load.status_code == 400 and "enable_lora" in load.json()["error"]["message"]
        assert server.get("/models/tiny/adapters").json() == {"adapters": []}
        assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny"]


def test_the_adapter_apis_need_the_api_key_when_one_is_set(tiny_dir):
    with fresh_server(**_options(tiny_dir, api_key="sesame")) as server:
        src = str(tiny_dir / "runtime/beta")
        assert server.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": src}).status_code == 401
        assert server.post("/models/tiny/adapters", params={"name": "beta", "src": src}).status_code == 401
        assert _delete(server, "/models/tiny/adapters/alpha").status_code == 401
        auth = {"Authorization": "Bearer sesame"}
        assert server.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": src},
                           headers=auth).status_code == 200
        assert _delete(server, "/models/tiny/adapters/alpha", headers=auth).status_code == 200


def test_loading_and_unloading_while_requests_run_fails_none_of_them(tiny_dir):
    with fresh_server(**_options(tiny_dir)) as server:
        src = str(tiny_dir / "runtime/beta")

        async def churn():
            generate = [server.client.post("/invocations", json={"inputs": f"hello {i}",
                                                                 "parameters": {"max_new_tokens": 8}})
                        for i in range(4)]
            admin = []
            for _ in range(3):
                admin += [server.client.post("/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": src}),
                          server.client.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})]
            return await asyncio.gather(*generate), [await call for call in admin]

        answers, admin = server.loop.run_until_complete(churn())
        assert [r.status_code for r in answers] == [200] * 4
        assert [r.status_code for r in admin] == [200] * 6 and _names(server) == ["alpha"]


def test_the_djl_front_ends_adapter_header_gives_its_item_the_adapters_answer_beside_a_base_item(tiny_dir):
    """DJL's container path (handle(), no bundled server): the item's X-Amzn-SageMaker-Adapter-Identifier
    property names the adapter; that item gets transformers' tokens with it merged, the base item beside it
    the base's."""
    from lmi_handler.djl import OwnInput, PairList, binary_decode
    from lmi_handler.handler import Handler

    worker = Handler()
    assert worker.handle(OwnInput({"model_id": str(tiny_dir / "tiny"), "enable_lora": "true", "num_threads": "1",
                                   "device_id": "-1"})) is None
    props, content = {"batch_size": "2", "batch_000.X-Amzn-SageMaker-Adapter-Identifier": "alpha"}, PairList()
    for i, request_id in enumerate(("with-adapter", "base")):
        content.add(f"batch_{i:03d}.data", json.dumps({"inputs": "hello", "parameters": {
            **GREEDY, "details": True, "decoder_input_details": True}}).encode())
        props[f"batch_{i:03d}.Content-Type"] = "application/json"
        props[f"batch_{i:03d}.requestId"] = request_id
    output = worker.handle(OwnInput(props, content))
    data, last = ["", ""], [False, False]
    for _ in range(20):                     # later calls: the running items, empty data, until both end
        for i in range(2):
            entry = binary_decode(output.content.value_at(i)) if output.content.size() > i else None
            if entry is not None and not last[i]:
                assert "code" not in entry, entry
                data[i] += entry["data"]
                last[i] = entry["last"] == "true"
        if all(last):
            break
        running, content = {"batch_size": "2"}, PairList()
        for i in range(2):
            content.add(f"batch_{i:03d}.data", b"")
        output = worker.handle(OwnInput(running, content))
    adapter, base = (json.loads(d) for d in data)
    prompt_ids = [t["id"] for t in adapter["details"]["prefill"]]
    assert [t["id"] for t in adapter["details"]["tokens"]] == _merged_greedy(tiny_dir, prompt_ids, 6)
    assert [t["id"] for t in base["details"]["prefill"]] == prompt_ids and base["generated_text"] != adapter[
        "generated_text"]


@pytest.mark.slow
def test_under_tensor_parallelism_a_request_naming_an_adapter_answers_501_and_the_base_is_served(tiny_dir):
    """Tensor-parallel shards hold a slice of each projection's input, which the LoRA term needs whole: the
    adapters load and list, a request naming one answers 501 saying why (never the base's answer), the base 200."""
    with fresh_server(**_options(tiny_dir, tensor_parallel_degree="2", kv_cache_bytes=str(8 << 20))) as server:
        assert _names(server) == ["alpha"]
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
        assert server.post("/invocations", json=body).status_code == 200
        refused = server.post("/invocations", json={**body, "adapters": "alpha"})
        assert refused.status_code == 501 and "not applied under tensor parallelism" in refused.text, refused.text
        chat = server.post("/v1/completions", json={"model": "alpha", "prompt": "hello", "max_tokens": 2})
        assert chat.status_code == 501 and "tensor parallelism" in chat.json()["error"]["message"]
