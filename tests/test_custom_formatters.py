"""LMI's model.py formatters on a tiny random Llama: LMI's documented examples change the answers as its docs say,
streamed and not, through the real app and through handle(); with djl_python absent (this package's stand-in
answers model.py's djl_python imports) and, where it is installed, with djl_python itself; a raising formatter
fails only its request; a model.py that cannot be imported refuses the start with its traceback's last line."""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys

import pytest

from lmi_handler.config import ConfigError
from lmi_handler.custom_formatters import CustomFormatters, ModelCodeError, load_model_code
from lmi_handler.djl import binary_decode
from tests import custom_formatter_examples as examples
from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer
from tests.engine.lora_helpers import write_peft_adapter
from tests.helpers import SMALL_KV_CACHE_BYTES, server_process
from tests.server.helpers import fresh_server

GREEDY = {"do_sample": False, "ignore_eos": True}
PROMPT = "hello world"


class _HideDjlPython(importlib.abc.MetaPathFinder):
    """Makes `import djl_python` fail as it does where djl_python is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "djl_python" or name.startswith("djl_python."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def _djl_python_installed() -> bool:
    try:
        return importlib.util.find_spec("djl_python") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(params=["djl_python absent", "djl_python installed"])
def djl_python(request, monkeypatch):
    """Each test once with djl_python hidden (our stand-in answers model.py's imports) and once with the real
    djl_python, where it is installed (it is not on PyPI: install it from djl-serving's engines/python/setup)."""
    if request.param == "djl_python installed":
        if not _djl_python_installed():
            pytest.skip("djl_python is not installed here (not on PyPI)")
        return request.param
    monkeypatch.setattr(sys, "meta_path", [_HideDjlPython(), *sys.meta_path])
    for name in [n for n in sys.modules if n == "djl_python" or n.startswith("djl_python.")]:
        monkeypatch.delitem(sys.modules, name)
    return request.param


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama checkpoint (and its model config) that each test's model folder links to."""
    root = tmp_path_factory.mktemp("tiny_formatters")
    model = build_tiny_llama(root / "tiny", max_position_embeddings=512)   # room for the example's 256 tokens
    build_tiny_tokenizer().save_pretrained(root / "tiny")
    return root / "tiny", model.config


def model_folder(tmp_path, tiny, code: str | None, adapters: dict[str, str | None] | None = None):
    """A model folder: the tiny checkpoint's files, `code` as its model.py, and LoRA adapters under adapters/
    (name -> the adapter's own model.py, or None for none)."""
    source, config = tiny
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    for path in source.iterdir():
        (folder / path.name).symlink_to(path)
    if code is not None:
        (folder / "model.py").write_text(code)
    for index, (name, adapter_code) in enumerate((adapters or {}).items()):
        write_peft_adapter(folder / "adapters" / name, config, seed=index + 1)
        if adapter_code is not None:
            (folder / "adapters" / name / "model.py").write_text(adapter_code)
    return folder


def options(folder, **extra) -> dict[str, str]:
    return {"model_id": str(folder), "num_threads": "1", "kv_cache_bytes": str(SMALL_KV_CACHE_BYTES), **extra}


def jsonlines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def stream_text(server, body: dict) -> tuple[int, str, str]:
    async def run():
        async with server.client.stream("POST", "/invocations", json={**body, "stream": True}) as response:
            return response.status_code, response.headers["content-type"], "".join(
                [chunk async for chunk in response.aiter_text()])
    return server.loop.run_until_complete(run())


# ---- input formatters ---------------------------------------------------------------------------

def test_lmis_input_formatter_example_reads_input_prompt_and_defaults_max_new_tokens(tmp_path, tiny, djl_python):
    with fresh_server(**options(model_folder(tmp_path, tiny, examples.LMI_INPUT_EXAMPLE))) as server:
        plain = server.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5, **GREEDY}})
        custom = server.post("/invocations", json={"inputPrompt": PROMPT,
                                                    "parameters": {"max_new_tokens": 5, **GREEDY}})
        assert custom.status_code == 200, custom.text
        assert custom.json() == plain.json()
        defaulted = server.post("/invocations", json={"inputPrompt": PROMPT,
                                                       "parameters": {"details": True, **GREEDY}})
        assert defaulted.json()["details"]["generated_tokens"] == 256        # the example's default
        lines = jsonlines(stream_text(server, {"inputPrompt": PROMPT, "parameters": {"max_new_tokens": 3}})[2])
        assert len(lines) == 3 and "generated_text" in lines[-1]
        chat = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert chat.status_code == 200         # other routes keep their own schema


def test_an_adapters_own_formatters_answer_its_requests_and_the_base_ones_the_rest(tmp_path, tiny, djl_python):
    adapter_code = examples.LMI_ADAPTER_INPUT_EXAMPLE + examples.LMI_ADAPTER_DICT_OUTPUT_EXAMPLE
    folder = model_folder(tmp_path, tiny, examples.LMI_INPUT_EXAMPLE,
                          adapters={"my_adapter": adapter_code, "plain": None})
    with fresh_server(**options(folder, enable_lora="true")) as server:
        def inputs_seen(**body) -> str:
            response = server.post("/invocations", json={**body, "parameters": {"details": True,
                                                                                 "max_new_tokens": 2}})
            assert response.status_code == 200, response.text
            return response.json()["details"]["inputs"]
        assert inputs_seen(inputs=PROMPT, adapters="my_adapter") == f"[ADAPTER_PREFIX] {PROMPT}"
        header = server.post("/invocations", json={"inputs": PROMPT, "parameters": {"details": True,
                                                                                    "max_new_tokens": 2}},
                             headers={"X-Amzn-SageMaker-Adapter-Identifier": "my_adapter"})
        assert header.json()["details"]["inputs"] == f"[ADAPTER_PREFIX] {PROMPT}"
        assert inputs_seen(inputPrompt=PROMPT, adapters="plain") == PROMPT     # no model.py: the base's
        assert inputs_seen(inputPrompt=PROMPT) == PROMPT
        answer = server.post("/invocations", json={"inputs": PROMPT, "adapters": "my_adapter",
                                                   "parameters": {"max_new_tokens": 3, **GREEDY}}).json()
        assert answer["generated_text"].startswith("[ADAPTER] ") and answer["adapter_name"] == "my_adapter"
        assert answer["custom_metrics"]["text_length"] == len(answer["generated_text"]) - len("[ADAPTER] ")
        base = server.post("/invocations", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).json()
        assert set(base) == {"generated_text"}                     # the base model.py has no output formatter


def test_an_adapter_loaded_at_run_time_brings_its_model_py_and_a_broken_one_is_refused(tmp_path, tiny, djl_python):
    folder = model_folder(tmp_path, tiny, None)
    _, config = tiny
    for name, code in (("good", examples.LMI_ADAPTER_DICT_OUTPUT_EXAMPLE), ("broken", examples.BROKEN)):
        write_peft_adapter(tmp_path / "runtime" / name, config)
        (tmp_path / "runtime" / name / "model.py").write_text(code)
    with fresh_server(**options(folder, enable_lora="true", lora_adapter_roots=str(tmp_path / "runtime"))) as server:
        broken = server.post("/models/model/adapters", params={"name": "broken",
                                                              "src": str(tmp_path / "runtime/broken")})
        assert broken.status_code == 400
        assert "ModuleNotFoundError: No module named 'not_a_module_anywhere'" in broken.json()["error"]
        assert server.get("/models/model/adapters").json()["adapters"] == []       # not registered
        assert server.post("/models/model/adapters", params={"name": "good",
                                                            "src": str(tmp_path / "runtime/good")}).status_code == 200
        answer = server.post("/invocations", json={"inputs": PROMPT, "adapters": "good",
                                                   "parameters": {"max_new_tokens": 2}}).json()
        assert answer["adapter_name"] == "my_adapter"
        unloaded = server.loop.run_until_complete(server.client.request("DELETE", "/models/model/adapters/good"))
        assert unloaded.status_code == 200
        assert server.service.formatters.adapters == {}


def test_a_raising_input_formatter_answers_500_naming_it_and_others_are_served(tmp_path, tiny, djl_python):
    folder = model_folder(tmp_path, tiny, examples.FAILING_INPUT)
    with fresh_server(**options(folder)) as server:
        failed = server.post("/invocations", json={"inputs": PROMPT})
        assert failed.status_code == 500
        assert failed.json() == {"code": 500, "error": "the input formatter custom_input_formatter of model.py "
                                 "failed: RuntimeError: Input formatter intentionally failed"}
        assert server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# ---- output formatters --------------------------------------------------------------------------

def test_lmis_output_formatter_example_answers_one_line_per_token_streamed_and_not(tmp_path, tiny, djl_python):
    with fresh_server(**options(model_folder(tmp_path, tiny, examples.LMI_OUTPUT_EXAMPLE))) as server:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **GREEDY}}
        whole = server.post("/invocations", json=body)
        assert whole.status_code == 200 and whole.headers["content-type"].startswith("application/json")
        lines = jsonlines(whole.text)
        code, content_type, streamed = stream_text(server, body)
        assert code == 200 and content_type.startswith("application/jsonlines")
        assert jsonlines(streamed) == lines
        assert [set(line) for line in lines] == [{"token_id", "token_text", "token_log_prob"}] * 3 + [
            {"token_id", "token_text", "token_log_prob", "finish_reason"}]
        assert lines[-1]["finish_reason"] == "length"
    with fresh_server(**options(model_folder(tmp_path / "builtin", tiny, None))) as server:    # no model.py
        builtin = server.post("/invocations", json={**body, "parameters": {**body["parameters"], "details": True}})
        tokens = builtin.json()["details"]["tokens"]
        assert [line["token_id"] for line in lines] == [t["id"] for t in tokens]
        assert "".join(line["token_text"] for line in lines) == builtin.json()["generated_text"]


def test_lmis_dict_output_formatter_example_reshapes_the_answer_and_the_last_stream_line(tmp_path, tiny, djl_python):
    with fresh_server(**options(model_folder(tmp_path, tiny, examples.LMI_DICT_OUTPUT_EXAMPLE))) as server:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **GREEDY}}
        answer = server.post("/invocations", json=body).json()
        assert answer["custom_formatter_applied"] is True and isinstance(answer["formatter_timestamp"], int)
        assert answer["generated_text"].startswith("[BASE] ")
        assert answer["original_length"] == len(answer["generated_text"]) - len("[BASE] ")
        lines = jsonlines(stream_text(server, body)[2])
        assert lines[-1]["generated_text"] == answer["generated_text"]
        assert all("custom_formatter_applied" not in line for line in lines[:-1])  # no generated_text there


def test_option_output_formatter_names_a_model_py_function(tmp_path, tiny, djl_python):
    folder = model_folder(tmp_path, tiny, examples.NAMED_OUTPUT)
    with fresh_server(**options(folder, output_formatter="shout")) as server:
        text = server.post("/invocations", json={"inputs": PROMPT,
                                                 "parameters": {"max_new_tokens": 4, **GREEDY}}).text
        assert text.startswith("<") and text.endswith(">") and text == text.upper()
    with pytest.raises(ConfigError, match="option.output_formatter='whisper': not one of json, jsonlines, sse, "
                                          "and .*model.py defines no function of that name"):
        fresh_server(**options(folder, output_formatter="whisper")).__enter__()


def test_a_raising_output_formatter_fails_only_its_own_request(tmp_path, tiny, djl_python):
    with fresh_server(**options(model_folder(tmp_path, tiny, examples.FAILING_OUTPUT_OURS))) as server:
        params = {"max_new_tokens": 8, **GREEDY}
        good, bad = server.gather(server.client.post("/invocations", json={"inputs": PROMPT, "parameters": params}),
                                  server.client.post("/invocations", json={"inputs": "please fail",
                                                                            "parameters": params}))
        assert good.status_code == 200 and good.text == good.text.upper() and good.text
        assert bad.status_code == 500
        assert bad.json()["error"] == ("the output formatter picky_formatter of model.py failed: "
                                       "ValueError: this prompt asked me to fail")
        refused = server.post("/invocations", json={"inputs": PROMPT, "parameters": {"n": 2, "do_sample": True}})
        assert refused.status_code == 400 and "answers one sequence" in refused.json()["error"]


# ---- handle(), as the container's front end drives it ---------------------------------------------

def _step(worker, items):
    from lmi_handler.djl import OwnInput, PairList

    props, content = {"batch_size": str(len(items))}, PairList()
    for i, (request_id, body) in enumerate(items):
        content.add(f"batch_{i:03d}.data", body or b"")
        if body is not None:
            props.update({f"batch_{i:03d}.Content-Type": "application/json", f"batch_{i:03d}.requestId": request_id})
    output = worker.handle(OwnInput(props, content))
    return [binary_decode(output.content.value_at(i)) for i in range(len(items))]


def test_handle_applies_both_formatters_and_a_failing_one_ends_only_its_item(tmp_path, tiny, djl_python):
    from lmi_handler.djl import OwnInput
    from lmi_handler.handler import Handler

    code = examples.LMI_INPUT_EXAMPLE + examples.FAILING_OUTPUT_OURS.replace("from lmi_handler", "from djl_python")
    folder = model_folder(tmp_path, tiny, code)
    worker = Handler()     # DJL's model_dir is the model folder, where LMI looks for model.py
    assert worker.handle(OwnInput({**options(folder), "model_dir": str(folder), "max_rolling_batch_size": "4",
                                   "device_id": "-1", "cluster_size": 1})) is None
    params = {"max_new_tokens": 3, **GREEDY}
    good = json.dumps({"inputPrompt": PROMPT, "parameters": params, "stream": True}).encode()
    bad = json.dumps({"inputPrompt": "do fail", "parameters": params, "stream": True}).encode()
    first = _step(worker, [("good", good), ("bad", bad)])
    assert first[1]["last"] == "true" and first[1]["code"] == "500" and "picky_formatter" in first[1]["error"]
    texts, entries = [first[0]["data"]], first
    while entries[0]["last"] != "true":
        entries = _step(worker, [("good", None)])
        texts.append(entries[0]["data"])
    assert "".join(texts) and "".join(texts) == "".join(texts).upper()


def test_dynamic_batch_applies_the_input_formatter_and_a_failing_one_answers_its_item_500(tmp_path, tiny):
    from lmi_handler.djl import OwnInput, PairList
    from lmi_handler.handler import Handler

    folder = model_folder(tmp_path, tiny, examples.PICKY_INPUT_OURS)
    worker = Handler()
    assert worker.handle(OwnInput({**options(folder), "model_dir": str(folder), "rolling_batch": "disable"})) is None
    bodies = [{"inputPrompt": PROMPT, "parameters": {"max_new_tokens": 2}}, {"inputPrompt": PROMPT, "fail": True}]
    content = PairList([(f"batch_{i:03d}.data", json.dumps(b).encode()) for i, b in enumerate(bodies)])
    output = worker.handle(OwnInput({"batch_size": "2"}, content))
    good, bad = (json.loads(output.content.value_at(i)) for i in range(2))
    assert isinstance(good[0]["generated_text"], str) and "batch_0_code" not in output.properties
    assert output.properties["batch_1_code"] == "500"
    assert bad == {"code": 500, "error": "the input formatter picky_input of model.py failed: "
                                         "ValueError: this body asked me to fail"}


# ---- loading model.py ---------------------------------------------------------------------------

def test_a_model_py_that_cannot_import_refuses_the_start_with_its_last_line(tmp_path, tiny):
    folder = model_folder(tmp_path, tiny, examples.BROKEN)
    with pytest.raises(ModelCodeError, match="model.py cannot be imported: ModuleNotFoundError: No module named "
                                             "'not_a_module_anywhere'"):
        fresh_server(**options(folder)).__enter__()


@pytest.mark.slow
def test_the_cli_server_refuses_a_broken_model_py_naming_its_last_line(tmp_path, tiny, tmp_path_factory):
    server = server_process(tmp_path_factory, "broken_model_py", **options(model_folder(tmp_path, tiny,
                                                                                         examples.BROKEN)))
    with pytest.raises(RuntimeError, match="server exited"):
        server.__enter__()
    assert "ModuleNotFoundError: No module named 'not_a_module_anywhere'" in server.log_path.read_text()


def test_without_djl_python_model_py_gets_the_stand_in_and_the_process_never_sees_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_HideDjlPython(), *sys.meta_path])
    for name in [n for n in sys.modules if n.startswith("djl_python")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "model.py").write_text(examples.LMI_INPUT_EXAMPLE + examples.LMI_OUTPUT_EXAMPLE)
    code = load_model_code(tmp_path, "stand_in_test")
    assert code.input_formatter.__name__ == "custom_input_formatter"
    assert code.output_formatter.__name__ == "custom_output_formatter"
    assert not any(n.startswith("djl_python") for n in sys.modules)
    (tmp_path / "model.py").write_text("from djl_python import Input\n")
    with pytest.raises(ModelCodeError, match=r"cannot be imported: \w*Error: .*'(djl_python\.)?Input'"):  # not ours
        load_model_code(tmp_path, "stand_in_test")


def test_where_djl_python_is_installed_model_py_imports_the_real_one(tmp_path):
    if not _djl_python_installed():
        pytest.skip("djl_python is not installed here (not on PyPI)")
    (tmp_path / "model.py").write_text(examples.LMI_INPUT_EXAMPLE)
    code = load_model_code(tmp_path, "installed_test")
    assert code.input_formatter.is_input_formatter is True
    assert "lmi_handler" not in (sys.modules["djl_python.input_parser"].__doc__ or "")   # not our stand-in
    assert sys.modules["djl_python.input_parser"].__file__.endswith("djl_python/input_parser.py")


def test_two_marked_input_formatters_are_refused(tmp_path):
    (tmp_path / "model.py").write_text("from lmi_handler.input_parser import input_formatter\n"
                                       "@input_formatter\ndef a(p): return p\n@input_formatter\ndef b(p): return p\n")
    with pytest.raises(ModelCodeError, match=r"marks 2 functions as input_formatter \(a, b\): keep one"):
        CustomFormatters.load([tmp_path], None)


def test_an_output_formatter_under_dynamic_batch_refuses_the_start(tmp_path, tiny):
    folder = model_folder(tmp_path, tiny, examples.LMI_OUTPUT_EXAMPLE)
    with pytest.raises(ConfigError, match="output formatter needs the rolling batch"):
        fresh_server(**options(folder, rolling_batch="disable")).__enter__()
