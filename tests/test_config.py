"""serving.properties + OPTION_* environment -> Settings (LMI configuration rules)."""
import re
from pathlib import Path

import pytest

from lmi_handler.config import ConfigError, MpiLaunch, Settings, read_mpi_launch, read_serving_properties


def test_option_keys_lose_their_prefix_and_env_overrides_win(tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text("engine=Python\noption.model_id=model\noption.max_rolling_batch_size=4\nbatch_size=2\n# c\n")
    props = read_serving_properties(path, environ={"OPTION_MAX_ROLLING_BATCH_SIZE": "8", "OPTION_DTYPE": "fp32",
                                                   "UNRELATED": "x"})
    assert props["model_id"] == "model" and props["batch_size"] == "2" and props["engine"] == "Python"
    assert props["max_rolling_batch_size"] == "8" and props["dtype"] == "fp32"
    assert props["model_dir"] == str(tmp_path.resolve())
    settings = Settings.from_properties(props)
    assert settings.max_rolling_batch_size == 8 and settings.dtype == "float32"
    assert settings.model_path == tmp_path.resolve() / "model"


@pytest.mark.parametrize("value, rolling", [("disable", False), ("DISABLE", False), ("lmi_handler", True),
                                            ("auto", True), ("vllm", True)])
def test_every_rolling_batch_value_but_disable_is_rolling(value, rolling):
    assert Settings.from_properties({"rolling_batch": value}).is_rolling is rolling


@pytest.mark.parametrize("key, value", [("max_rolling_batch_size", "0"), ("dtype", "int8"),
                                        ("output_formatter", "x.m-l"), ("tensor_parallel_degree", "0"),
                                        ("tensor_parallel_degree", "two"), ("pipeline_parallel_degree", "2"),
                                        ("max_rolling_batch_size", "many")])
def test_bad_values_raise_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        Settings.from_properties({key: value})


def test_handle_properties_with_int_cluster_size_and_handler_are_accepted():
    settings = Settings.from_properties({"model_id": "/m", "cluster_size": 1, "handler": "handle", "tgi_compat": "true"})
    assert settings.tgi_compat is True and str(settings.model_path) == "/m"


def test_engine_slice_carries_the_engine_options():
    settings = Settings.from_properties({"max_rolling_batch_size": "8", "max_rolling_batch_prefill_tokens": "16",
                                         "num_threads": "1", "block_size": "32",
                                         "enable_prefix_caching": "false"})
    engine = settings.engine_config()
    assert engine.max_num_seqs == 8 and engine.max_num_batched_tokens == 16
    assert engine.num_threads == 1 and engine.block_size == 32
    assert engine.enable_prefix_caching is False and Settings().engine_config().enable_prefix_caching is True


def test_serving_properties_is_read_as_java_properties(tmp_path):
    """DJL reads the file with java.util.Properties: `key: value`, `key value`, continuations and escapes."""
    path = tmp_path / "serving.properties"
    path.write_text("option.model_id: model\n"
                    "option.dtype fp32\n"
                    "option.max_rolling_batch_size = \\\n"
                    "    12\n"
                    "! a comment\n"
                    "option.output_formatter=json   \n"
                    "option.tgi_compat=\\u0074rue\n", encoding="utf-8")
    props = read_serving_properties(path, environ={})
    assert props["model_id"] == "model" and props["dtype"] == "fp32"
    assert props["max_rolling_batch_size"] == "12"
    assert props["output_formatter"] == "json" and props["tgi_compat"] == "true"
    settings = Settings.from_properties(props)
    assert settings.max_rolling_batch_size == 12 and settings.tgi_compat is True


def test_a_missing_file_gives_just_the_environment_overrides(tmp_path):
    props = read_serving_properties(tmp_path / "absent.properties", environ={"OPTION_DTYPE": "bf16"})
    assert props == {"dtype": "bf16", "model_dir": str(tmp_path.resolve())}


@pytest.mark.parametrize("value, degree", [("3", 3), (2, 2), ("max", "max"), ("MAX", "max")])
def test_tensor_parallel_degree_is_a_count_or_max(value, degree):
    settings = Settings.from_properties({"tensor_parallel_degree": value})
    assert settings.tensor_parallel_degree == degree
    assert settings.engine_config().parallel.tensor_parallel_degree == degree


def test_pipeline_parallel_degree_other_than_1_is_refused_naming_it():
    assert Settings.from_properties({"pipeline_parallel_degree": "1"}).pipeline_parallel_degree == 1
    with pytest.raises(ConfigError, match=r"^option\.pipeline_parallel_degree='4': .*only 1"):
        Settings.from_properties({"pipeline_parallel_degree": "4"})


def test_tensor_parallel_degree_env_applies_only_when_no_option_sets_it(tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text("option.model_id=model\n")
    assert read_serving_properties(path, environ={"TENSOR_PARALLEL_DEGREE": "max"})["tensor_parallel_degree"] == "max"
    both = read_serving_properties(path, environ={"TENSOR_PARALLEL_DEGREE": "max", "OPTION_TENSOR_PARALLEL_DEGREE": "2"})
    assert both["tensor_parallel_degree"] == "2"
    path.write_text("option.tensor_parallel_degree=3\n")
    assert read_serving_properties(path, environ={"TENSOR_PARALLEL_DEGREE": "max"})["tensor_parallel_degree"] == "3"


def test_the_mpi_launch_is_read_from_open_mpi_and_djls_variables():
    assert read_mpi_launch({}) is None
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "19000"}
    assert read_mpi_launch(env) == MpiLaunch(rank=2, world_size=3, local_rank=2, master_addr="127.0.0.1",
                                             master_port=19000)
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        read_mpi_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"})


def test_huge_pages_are_on_by_default_and_off_with_the_option_or_lmi_huge_pages_0():
    assert Settings.from_properties({}, environ={}).engine_config().huge_pages is True
    assert Settings.from_properties({}, environ={"LMI_HUGE_PAGES": "0"}).engine_config().huge_pages is False
    assert Settings.from_properties({"huge_pages": "false"}, environ={}).engine_config().huge_pages is False
    # the properties (option.huge_pages, OPTION_HUGE_PAGES) win over the environment switch
    assert Settings.from_properties({"huge_pages": "true"}, environ={"LMI_HUGE_PAGES": "0"}).huge_pages is True
    with pytest.raises(ConfigError, match="huge_pages"):
        Settings.from_properties({}, environ={"LMI_HUGE_PAGES": "sometimes"})


def test_only_config_reads_the_environment():
    """STYLE: nothing reads os.environ outside config/ (switches arrive as Settings fields), and inside it only
    environment.py does."""
    import lmi_handler

    package = Path(lmi_handler.__file__).parent
    readers = [str(path.relative_to(package)) for path in package.rglob("*.py")
               if "os.environ" in path.read_text() or "getenv(" in path.read_text()]
    assert readers == ["config/environment.py"]


def test_job_queue_size_is_a_top_level_key_with_the_environment_as_djls_default(tmp_path):
    props = tmp_path / "serving.properties"
    props.write_text("option.model_id=model\n")
    assert Settings.from_properties(read_serving_properties(props, {})).job_queue_size == 1000
    assert read_serving_properties(props, {"SERVING_JOB_QUEUE_SIZE": "4"})["job_queue_size"] == "4"
    props.write_text("job_queue_size=7\n")
    assert read_serving_properties(props, {"SERVING_JOB_QUEUE_SIZE": "4"})["job_queue_size"] == "7"


def test_enable_streaming_and_strict_model_name_are_off_by_default_and_read_as_booleans():
    assert (Settings().enable_streaming, Settings().strict_model_name) == (False, False)
    settings = Settings.from_properties({"enable_streaming": "true", "strict_model_name": "TRUE"})
    assert settings.enable_streaming and settings.strict_model_name
    with pytest.raises(ConfigError, match="strict_model_name"):
        Settings.from_properties({"strict_model_name": "sometimes"})


@pytest.mark.parametrize(("properties", "words"), [
    ({"tool_call_parser": "qwen"}, "option.tool_call_parser='qwen': Input should be 'hermes', 'llama3_json', "
                                   "'mistral' or 'pythonic'"),
    ({"enable_auto_tool_choice": "true"}, "enable_auto_tool_choice=true needs a tool_call_parser (one of hermes, "
                                          "llama3_json, mistral, pythonic)"),
    ({"reasoning_parser": "o1"}, "option.reasoning_parser='o1': Input should be 'deepseek_r1' or 'qwen3'"),
])
def test_tool_and_reasoning_parsers_are_checked_at_start_up_naming_the_allowed_ones(properties, words):
    with pytest.raises(ConfigError) as info:
        Settings.from_properties(properties, environ={})
    assert words in str(info.value)


def test_auto_tool_choice_with_a_parser_and_a_reasoning_parser_are_taken_in_any_case():
    settings = Settings.from_properties({"enable_auto_tool_choice": "true", "tool_call_parser": "Hermes",
                                         "reasoning_parser": "QWEN3"}, environ={})
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser, settings.reasoning_parser) == \
        (True, "hermes", "qwen3")


def test_settings_is_its_parts_composed_each_option_in_exactly_one_part():
    from lmi_handler.config import PARTS, BatchOptions, Options

    fields = [name for part in PARTS for name in part.model_fields if name not in Options.model_fields]
    assert sorted(fields) == sorted(set(Settings.model_fields) - set(Options.model_fields))     # none twice
    assert list(Settings.model_fields) == ["model_dir", *fields]       # Settings' order is PARTS' order
    assert BatchOptions(model_dir="/srv", batch_dir="jobs").batch_path == Path("/srv/jobs")  # a part stands alone


def test_the_retired_batch_invariant_option_is_ignored_with_one_warning_naming_why(caplog):
    """option.batch_invariant is gone (every kernel backend computes each row alone): a configuration that
    still sets it starts, with one warning saying so."""
    with caplog.at_level("WARNING", logger="lmi_handler.config"):
        settings = Settings.from_properties({"batch_invariant": "false"})
    assert not hasattr(settings, "batch_invariant") and not hasattr(settings.engine_config(), "batch_invariant")
    warnings = [r.getMessage() for r in caplog.records if "batch_invariant" in r.getMessage()]
    assert warnings == ["option.batch_invariant is retired: every kernel backend computes each row alone, so a "
                        "sequence's logits never depend on its batch (there is no faster non-invariant form left to "
                        "choose); ignored"]


def test_task_defaults_to_generation_and_takes_the_pooling_tasks_and_their_aliases():
    assert Settings.from_properties({}).task == "text-generation" and not Settings.from_properties({}).is_pooling
    for value, task in [("text-embedding", "text-embedding"), ("Embedding", "text-embedding"), ("score", "rerank"),
                        ("classify", "classification"), ("auto", "auto")]:
        settings = Settings.from_properties({"task": value})
        assert settings.task == task and settings.is_pooling


@pytest.mark.parametrize("properties, words", [({"task": "translate"}, "option.task='translate'"),
                                               ({"pooling": "median"}, "option.pooling='median'"),
                                               ({"normalize": "perhaps"}, "option.normalize='perhaps'")])
def test_pooling_options_refuse_unknown_values_naming_the_option(properties, words):
    with pytest.raises(ConfigError, match=words):
        Settings.from_properties(properties)


def test_pooling_and_normalize_are_unset_by_default_and_take_sentence_transformers_names():
    assert Settings.from_properties({}).pooling is None and Settings.from_properties({}).normalize is None
    settings = Settings.from_properties({"pooling": "last_token", "normalize": "true"})
    assert settings.pooling == "lasttoken" and settings.normalize is True
    assert Settings.from_properties({"pooling": "CLS"}).pooling == "cls"


# ---- speculative decoding (config/engine.py's block; engine/speculative/) -------------------------------------

def test_speculative_config_takes_vllms_json_and_lmis_draft_model_options(tmp_path):
    ngram = Settings.from_properties({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4, '
                                                            '"prompt_lookup_max": 3, "disable_by_batch_size": 8}'})
    spec = ngram.engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.disable_by_batch_size) == ("ngram", 4, 3, 3, 8)
    as_model = Settings.from_properties({"speculative_config": '{"model": "[ngram]", "num_speculative_tokens": 2}'})
    assert as_model.speculative().method == "ngram" and as_model.speculative().prompt_lookup_min == 5
    draft = Settings.from_properties({"model_dir": str(tmp_path),
                                      "speculative_config": '{"model": "draft", "num_speculative_tokens": 3}'})
    assert draft.speculative().method == "draft_model" and draft.speculative().draft_model == tmp_path / "draft"
    lmi = Settings.from_properties({"model_dir": str(tmp_path), "speculative_draft_model": "small",
                                    "speculative_length": "6"}).speculative()
    assert (lmi.method, lmi.draft_model, lmi.num_speculative_tokens) == ("draft_model", tmp_path / "small", 6)
    assert Settings.from_properties({}).engine_config().speculative is None


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle3", "model": "x", "num_speculative_tokens": 3}', "method 'eagle3': served methods are ngram"),
    ('{"method": "ngram"}', "num_speculative_tokens must be a whole number in [1, 16], got None"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', "num_speculative_tokens must be a whole number in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "method draft_model needs `model`"),
    ('{"model": "d", "num_speculative_tokens": 2, "acceptance": 1}', "unknown key(s) acceptance; known: method"),
    ('[4]', "must be a JSON object"), ('{"method": ', "invalid JSON")])
def test_a_bad_speculative_config_is_refused_at_start_up_naming_the_key(value, words):
    with pytest.raises(ConfigError, match=r"option\.speculative_config=.*" + re.escape(words)):
        Settings.from_properties({"speculative_config": value})


def test_speculative_config_and_speculative_draft_model_together_are_refused():
    with pytest.raises(ConfigError, match="set option.speculative_config or option.speculative_draft_model, not both"):
        Settings.from_properties({"speculative_draft_model": "d",
                                  "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'})
