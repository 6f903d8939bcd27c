"""The engine's side of LoRA: the registry made from option.enable_lora, and an adapter request refused
(never run on the base) while the model's forward does not apply adapters."""
from dataclasses import replace

import pytest

from lmi_handler.config import LoraConfig
from lmi_handler.engine.engine import LORA_NOT_APPLIED, Engine, RequestRejected
from lmi_handler.engine.sequence import SamplingParams
from tests.engine.lora_helpers import write_peft_adapter


def _config(model_dir):
    from lmi_handler.config import EngineConfig
    return EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                        max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22)


def test_an_adapter_request_is_refused_while_the_forward_cannot_apply_adapters(tiny_model_dir, tiny_tokenizer,
                                                                              tmp_path):
    from transformers import AutoConfig

    write_peft_adapter(tmp_path / "a", AutoConfig.from_pretrained(tiny_model_dir))
    engine = Engine(replace(_config(tiny_model_dir), lora=LoraConfig(max_loras=2, max_cpu_loras=2,
                                                                     adapter_roots=(tmp_path,))), tiny_tokenizer)
    engine.adapters.load("a", tmp_path / "a")
    assert engine.applies_lora is False
    with pytest.raises(RequestRejected, match="does not apply them yet") as err:
        engine.add_request("r", [1, 5, 6], SamplingParams(adapter="a"))
    assert str(err.value) == LORA_NOT_APPLIED and not engine.has_unfinished
    engine.add_request("base", [1, 5, 6], SamplingParams(max_new_tokens=2))      # the base is served as ever
    assert engine.seqs["base"].adapter is None and engine.seqs["base"].params.adapter is None


def test_with_lora_off_the_engine_has_no_registry_and_refuses_adapter_requests(tiny_model_dir, tiny_tokenizer):
    engine = Engine(_config(tiny_model_dir), tiny_tokenizer)
    assert engine.adapters is None
    with pytest.raises(RequestRejected, match="option.enable_lora"):
        engine.add_request("r", [1, 5], SamplingParams(adapter="a"))
