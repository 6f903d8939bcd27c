"""Options we do not serve are never dropped in silence (option_names.py, Settings.from_properties): another
engine's option is logged by name, a misspelling of ours is refused with the nearest name, DJL's keys pass."""
from __future__ import annotations

import logging

import pytest

from lmi_handler.config import ConfigError, Settings, read_serving_properties
from lmi_handler.option_names import FOREIGN_OPTIONS, FRONT_END_KEYS, Kind, sort_key

OURS = frozenset(Settings.model_fields)


@pytest.mark.parametrize("key", ["fully_sharded_loras", "kv_cache_dtype", "lora_dtype", "swap_space"])
def test_an_lmi_or_vllm_option_we_do_not_serve_logs_a_warning_naming_it_at_start_up(key, caplog):
    with caplog.at_level(logging.WARNING, logger="lmi_handler.config"):
        settings = Settings.from_properties({key: "true", "max_rolling_batch_size": "8"})
    assert settings.max_rolling_batch_size == 8
    assert [r.getMessage() for r in caplog.records if f"option.{key} " in r.getMessage()], caplog.text


def test_a_vllm_option_with_an_equivalent_here_names_ours(caplog):
    with caplog.at_level(logging.WARNING, logger="lmi_handler.config"):
        Settings.from_properties({"max_num_seqs": "8"})
    assert "option.max_num_seqs" in caplog.text and "option.max_rolling_batch_size does its job here" in caplog.text


@pytest.mark.parametrize("key, nearest", [("max_rolling_batch_sizes", "max_rolling_batch_size"),
                                          ("tensor_paralel_degree", "tensor_parallel_degree"), ("dtyp", "dtype"),
                                          ("enable_prefix_cache", "enable_prefix_caching"), ("revison", "revision"),
                                          ("generation_configs", "generation_config")])
def test_a_misspelt_option_of_ours_is_refused_naming_the_nearest(key, nearest):
    with pytest.raises(ConfigError, match=f"option.{key} is not an option: did you mean option.{nearest}\\?"):
        Settings.from_properties({key: "1"})


def test_a_misspelt_option_in_serving_properties_or_the_environment_is_refused(tmp_path):
    (tmp_path / "serving.properties").write_text("engine=Python\noption.max_rolling_batch_szie=4\n")
    with pytest.raises(ConfigError, match="max_rolling_batch_size"):
        Settings.from_properties(read_serving_properties(tmp_path / "serving.properties", environ={}))
    with pytest.raises(ConfigError, match="option.dtype"):
        Settings.from_properties(read_serving_properties(tmp_path / "none", environ={"OPTION_DTYPES": "fp32"}))


def test_djls_own_keys_and_handle_properties_pass_quietly(caplog):
    with caplog.at_level(logging.WARNING, logger="lmi_handler.config"):
        Settings.from_properties({"engine": "Python", "entryPoint": "lmi_handler.handler", "minWorkers": "1",
                                  "gpu.maxWorkers": "1", "cluster_size": 1, "handler": "handle", "batch_size": "4",
                                  "job_queue_size": "10", "max_idle_time": "60"})
    assert caplog.text == ""


def test_a_key_nothing_resembles_is_logged_not_refused_and_a_misspelt_foreign_one_is_not_taken_for_ours(caplog):
    with caplog.at_level(logging.WARNING, logger="lmi_handler.config"):
        Settings.from_properties({"my_custom_flag": "1", "max_num_seq": "4"})
    assert "option.my_custom_flag is not an option of this server: ignored" in caplog.text
    assert "nearest known name: option.max_num_seqs" in caplog.text


def test_what_is_ours_is_read_from_the_settings_fields_at_run_time():
    """A foreign name that becomes a field (as the tool-call and chat-template options did) is ours from then on."""
    assert sort_key("kv_cache_dtype", OURS) == (Kind.FOREIGN, None)
    assert sort_key("kv_cache_dtype", OURS | {"kv_cache_dtype"}) == (Kind.OURS, None)
    assert sort_key("speculative_config", OURS) == (Kind.OURS, None)
    assert sort_key("num_speculative_tokens", OURS) == (Kind.FOREIGN, "speculative_length")
    assert sort_key("chat_template", OURS) == (Kind.OURS, None)
    assert not (OURS & FRONT_END_KEYS - {"model_dir", "device_id", "batch_size", "max_batch_delay", "job_queue_size"})
    assert not OURS & set(FOREIGN_OPTIONS) - {"chat_template", "tool_call_parser", "enable_auto_tool_choice",
                                              "reasoning_parser"}
