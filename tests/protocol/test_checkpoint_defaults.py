"""generation_config.json's sampling values stand in for what a request leaves out (protocol/checkpoint_defaults.py):
vLLM's rule on the OpenAI routes and LMI chat; on LMI text, TGI and batch lines only when the request samples."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.batch_lines import BatchDefaults, check_line
from lmi_handler.protocol.checkpoint_defaults import CheckpointDefaults
from lmi_handler.protocol.dialects import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_GENERATE
from lmi_handler.protocol.invocations import InvocationRequest
from lmi_handler.protocol.plan import Kind, kind_of

# Qwen2.5-Instruct's generation_config.json sampling values (its do_sample true is not read)
QWEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "eos_token_id": [151645, 151643], "max_new_tokens": 2048}
CHAT = [{"role": "user", "content": "hi"}]


def checkpoint(tmp_path: Path, config: dict, mode: str = "auto") -> CheckpointDefaults:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return CheckpointDefaults.read(tmp_path, mode)


def planned(defaults: CheckpointDefaults, body: dict, route: str | None = None) -> SamplingParams:
    """The engine's knobs for a live request, as Service.plan_request applies the defaults."""
    request = InvocationRequest.parse(body, route=route)
    kind = kind_of(request.route, request.chat is not None, rolling=True)
    return defaults.apply(request.parameters, kind).to_sampling_params()


def batch_line(defaults: CheckpointDefaults, body: dict, batch: BatchDefaults | None = None) -> SamplingParams:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": ROUTE_CHAT, "body": {"messages": CHAT, **body}})
    checked = check_line(line, 1, batch or BatchDefaults())
    request = InvocationRequest.parse_openai(checked.body, checked.url)
    return defaults.apply(request.parameters, Kind.BATCH_LINE).to_sampling_params()


def knobs(params: SamplingParams) -> tuple:
    return params.greedy, params.temperature, params.top_p, params.top_k, params.repetition_penalty


def test_the_files_sampling_values_are_read_and_its_other_keys_are_not(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        defaults = checkpoint(tmp_path, QWEN)
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert "option.generation_config=vllm" in caplog.text and "temperature=0.7" in caplog.text


def test_option_generation_config_vllm_and_a_checkpoint_without_the_file_give_no_defaults(tmp_path):
    assert checkpoint(tmp_path, QWEN, mode="vllm").values == {}
    assert CheckpointDefaults.read(tmp_path / "elsewhere").values == {}


def test_the_demo_models_file_holds_no_sampling_values_so_its_greedy_answers_stay():
    assert CheckpointDefaults.read(Path(__file__).resolve().parents[2] / "model").values == {}


def test_a_value_the_request_schema_refuses_is_left_out_with_a_warning_naming_it(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        defaults = checkpoint(tmp_path, {"temperature": 0.6, "top_p": 1.5, "top_k": "many", "min_p": None})
    assert defaults.values == {"temperature": 0.6}
    assert "top_p=1.5" in caplog.text and "top_k='many'" in caplog.text


@pytest.mark.parametrize("route, body", [(ROUTE_CHAT, {"messages": CHAT}), (ROUTE_COMPLETIONS, {"prompt": "hi"}),
                                         (None, {"messages": CHAT})])
def test_openai_routes_and_lmi_chat_take_every_value_left_out_as_vllm_does(tmp_path, route, body):
    defaults = checkpoint(tmp_path, QWEN)
    assert knobs(planned(defaults, body, route)) == (False, 0.7, 0.8, 20, 1.05)
    sent = planned(defaults, {**body, "temperature": 1.0, "top_k": -1, "repetition_penalty": 1.0}, route)
    assert knobs(sent) == (False, 1.0, 0.8, 0, 1.0)          # what the request sent wins, -1 (off) included
    greedy = planned(defaults, {**body, "temperature": 0}, route)
    assert greedy.greedy and greedy.repetition_penalty == 1.05   # vLLM: the penalty applies to greedy requests too


def test_a_checkpoint_temperature_of_zero_makes_the_openai_routes_greedy_by_default(tmp_path):
    defaults = checkpoint(tmp_path, {"temperature": 0.0})
    assert planned(defaults, {"messages": CHAT}, ROUTE_CHAT).greedy
    assert not planned(CheckpointDefaults(), {"messages": CHAT}, ROUTE_CHAT).greedy   # vLLM's default: 1.0


@pytest.mark.parametrize("route", [None, ROUTE_GENERATE])
def test_lmi_and_tgi_requests_that_do_not_sample_keep_the_schema_defaults(tmp_path, route):
    defaults = checkpoint(tmp_path, QWEN)
    assert knobs(planned(defaults, {"inputs": "hi"}, route)) == (True, 1.0, 1.0, 0, 1.0)
    assert knobs(planned(defaults, {"inputs": "hi", "parameters": {"do_sample": False, "temperature": 0.5}},
                         route)) == (True, 0.5, 1.0, 0, 1.0)


@pytest.mark.parametrize("route", [None, ROUTE_GENERATE])
def test_lmi_and_tgi_requests_that_sample_take_the_values_they_leave_out(tmp_path, route):
    defaults = checkpoint(tmp_path, QWEN)
    assert knobs(planned(defaults, {"inputs": "hi", "parameters": {"do_sample": True}}, route)) == \
        (False, 0.7, 0.8, 20, 1.05)
    assert knobs(planned(defaults, {"inputs": "hi", "parameters": {"top_p": 0.9, "repetition_penalty": 1.0}},
                         route)) == (False, 0.7, 0.9, 20, 1.0)


def test_a_batch_line_without_temperature_stays_greedy_and_one_that_samples_takes_the_rest(tmp_path):
    defaults = checkpoint(tmp_path, QWEN)
    assert knobs(batch_line(defaults, {"max_tokens": 4})) == (True, 1.0, 1.0, 0, 1.0)      # DESIGN §4: greedy
    assert knobs(batch_line(defaults, {"max_tokens": 4, "temperature": 0.5})) == (False, 0.5, 0.8, 20, 1.05)
    by_batch = batch_line(defaults, {"max_tokens": 4}, BatchDefaults(temperature=0.9, top_p=0.5))
    assert knobs(by_batch) == (False, 0.9, 0.5, 20, 1.05)           # the batch-level value beats the checkpoint


def test_beam_search_takes_no_checkpoint_values(tmp_path):
    defaults = checkpoint(tmp_path, QWEN)
    params = planned(defaults, {"messages": CHAT, "n": 2, "use_beam_search": True}, ROUTE_CHAT)
    assert params.num_beams == 2 and params.repetition_penalty == 1.0


def test_a_checkpoint_top_k_of_1_makes_sampled_completions_the_greedy_answer_unless_generation_config_is_vllm(
        tmp_path):
    """Through the real app on a tiny random Llama whose generation_config.json says top_k 1: completions that
    sample (no temperature: vLLM's 1.0) with different seeds all give the greedy answer; with
    option.generation_config=vllm the file is not read, and the seeds part."""
    from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer
    from tests.server.helpers import fresh_server

    build_tiny_llama(tmp_path, tie_word_embeddings=False)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "top_k": 1}))

    def texts(server, **body) -> list[str]:
        answers = [server.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 8, "ignore_eos": True,
                                                         **body, **({"seed": seed} if seed else {})})
                   for seed in (None, 1, 2)]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        return [a.json()["choices"][0]["text"] for a in answers]

    options = dict(model_id=str(tmp_path), num_threads="1", kv_cache_bytes=str(16 << 20))
    with fresh_server(**options) as server:
        greedy, = set(texts(server, temperature=0))
        assert texts(server) == [greedy] * 3
    with fresh_server(**options, generation_config="vllm") as server:
        assert set(texts(server, temperature=0)) == {greedy}
        assert len(set(texts(server)[1:])) == 2
