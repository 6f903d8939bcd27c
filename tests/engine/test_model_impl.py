"""engine/model/model_impl.py: option.model_impl's choice between the layer description and the transformers
fallback, and the one-line start-up refusals of what neither serves."""
from __future__ import annotations

import json

import pytest

from lmi_handler.config import ConfigError, Settings
from lmi_handler.engine.model.model_impl import choose_impl
from tests.batch.helpers import COMPLETIONS, batch_line, write_jsonl

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
REMOTE = {"model_type": "tiny_remote", "auto_map": {"AutoConfig": "configuration_tiny.TinyConfig",
                                                    "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}


def test_auto_runs_a_family_with_a_layer_description_natively_and_any_other_decoder_through_transformers():
    assert choose_impl(LLAMA).fallback is False
    gpt2 = choose_impl(GPT2)
    assert gpt2.fallback and gpt2.name == "transformers" and gpt2.why.startswith("model_type=gpt2 has no layer")
    assert choose_impl(LLAMA, "transformers").fallback and choose_impl(LLAMA, " Native ").fallback is False
    assert choose_impl(REMOTE, trust_remote_code=True).fallback


@pytest.mark.parametrize(("cfg", "impl", "named"), [
    (GPT2, "native", ["model_type='gpt2' has no native implementation (option.model_impl=native)", "'qwen3'"]),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "auto",
     ["model_type='bert' is an encoder-only model: text generation serves decoder-only models", "qwen3",
      "option.task=text-embedding, rerank or classification serves the encoders"]),
    ({"model_type": "xlm-roberta"}, "transformers", ["model_type='xlm-roberta' is an encoder-only model"]),
    ({"model_type": "t5", "is_encoder_decoder": True}, "auto", ["model_type='t5' is an encoder-decoder model"]),
    (REMOTE, "auto", ["model_type='tiny_remote' needs trust_remote_code", "option.trust_remote_code=true",
                      "modeling_tiny.TinyForCausalLM", "qwen3"]),
    ({"model_type": "not_a_model"}, "auto", ["model_type='not_a_model' is not supported", "qwen3", "auto_map"]),
    (LLAMA, "vllm", ["option.model_impl='vllm'", "'auto', 'native', 'transformers'"]),
    ({**GPT2, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "auto",
     ["model_type='gpt2' with quantization_config (quant_method='gptq')", "not served"]),
])
def test_a_model_neither_implementation_serves_is_refused_in_one_line_naming_its_type_and_what_is(cfg, impl, named):
    with pytest.raises(ConfigError) as info:
        choose_impl(cfg, impl)
    assert "\n" not in str(info.value)
    for text in named:
        assert text in str(info.value)


def test_model_impl_and_trust_remote_code_are_options_of_the_model_part():
    settings = Settings.from_properties({"model_impl": " Transformers ", "trust_remote_code": "true"})
    assert settings.engine_config().model_impl == "transformers" and settings.engine_config().trust_remote_code
    assert Settings.from_properties({}).engine_config().model_impl == "auto"
    with pytest.raises(ConfigError, match="option.model_impl"):
        Settings.from_properties({"model_impl": "vllm"})


def test_lmi_handler_batch_refuses_an_encoder_at_start_up_with_one_line_and_status_2(tmp_path, capsys):
    from lmi_handler.cli import main

    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    props = tmp_path / "serving.properties"
    props.write_text(f"engine=Python\noption.model_id={model}\n")
    source = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", {"prompt": "x", "max_tokens": 2}, COMPLETIONS)])
    assert main(["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--properties", str(props)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config.json model_type='bert' is an encoder-only model") and err.count("\n") == 1
