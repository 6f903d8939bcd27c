"""The names of options this server does not serve: DJL's own keys, and LMI's and vLLM's engine options.

Owns sorting a configuration key that is not a Settings field into "the container's", "another engine's"
(logged, never silently dropped) or "a misspelt one of ours" (refused with the nearest name); which keys are
ours is read from the Settings fields at run time, so a field added there is never sorted here.
"""
from __future__ import annotations

import difflib
import enum
from typing import Iterable

# Keys DJL Serving itself reads from serving.properties, or adds to handle()'s properties (DESIGN §2): passed
# through quietly (lower case: Settings.from_properties lowers every key).
FRONT_END_KEYS = frozenset({
    "engine", "entrypoint", "handler", "cluster_size", "model_dir", "device_id", "job_queue_size", "batch_size",
    "max_batch_delay", "max_idle_time", "minworkers", "maxworkers", "load_on_devices", "required_memory_mb",
    "reserved_memory_mb", "model_loading_timeout", "predict_timeout", "parallel_loading", "translatorfactory",
    "mpi_mode", "pythonexecutable", "s3url",
})

# Options LMI's engines (vLLM, lmi-dist, TensorRT-LLM, transformers-neuronx) or vLLM's own arguments take that
# this server does not implement. Set, they are logged at start-up by name; where a key of ours does the same
# job, the value says which.
FOREIGN_OPTIONS: dict[str, str | None] = {
    # vLLM engine arguments with an equivalent here
    "max_num_seqs": "max_rolling_batch_size", "max_num_batched_tokens": "max_rolling_batch_prefill_tokens",
    "tensor_parallel_size": "tensor_parallel_degree", "pipeline_parallel_size": "pipeline_parallel_degree",
    "quantization": "quantize", "model": "model_id",
    "max_seq_len": "max_model_len", "n_positions": "max_model_len", "max_input_len": None,
    "enable_chunked_prefill": "max_rolling_batch_prefill_tokens",
    "disable_log_stats": None, "served_model_names": "served_model_name", "api_keys": "api_key",
    # LoRA and adapters
    "lora_dtype": None, "lora_extra_vocab_size": None, "fully_sharded_loras": None, "long_lora_scaling_factors": None,
    "enable_lora_bias": None, "adapters": None, "enable_prompt_adapter": None,
    "max_prompt_adapters": None, "max_prompt_adapter_token": None,
    # speculative decoding
    "speculative_model": "speculative_draft_model", "num_speculative_tokens": "speculative_length",
    "draft_model_tp_size": None, "record_acceptance_rate": None,
    # tool calls, reasoning, chat template (served once those options exist as fields)
    "enable_auto_tool_choice": None, "tool_call_parser": None, "tool_parser_plugin": None,
    "reasoning_parser": None, "enable_reasoning": None, "chat_template": None, "chat_template_content_format": None,
    "response_role": None,
    # memory, scheduling, kernels
    "swap_space": None, "cpu_offload_gb": None, "kv_cache_dtype": None,
    "max_seq_len_to_capture": None, "disable_custom_all_reduce": None, "num_scheduler_steps": None,
    "multi_step_stream_outputs": None, "use_v2_block_manager": None, "preemption_mode": None,
    "scheduler_delay_factor": None, "num_gpu_blocks_override": None,
    "num_lookahead_slots": None, "max_num_partial_prefills": None, "max_long_partial_prefills": None,
    "long_prefill_token_threshold": None, "disable_sliding_window": None, "disable_cascade_attn": None,
    "compilation_config": None, "cuda_graph_sizes": None, "async_scheduling": None, "enable_expert_parallel": None,
    "data_parallel_size": None, "distributed_executor_backend": None, "max_parallel_loading_workers": None,
    "kv_transfer_config": None, "kv_events_config": None, "enable_sleep_mode": None, "calculate_kv_scales": None,
    "prefix_caching_hash_algo": None, "block_manager_version": None, "disable_flash_attn": None,
    "device_map": None, "load_in_8bit": None, "load_in_4bit": None, "low_cpu_mem_usage": None,
    "rolling_batch_strategy": None, "max_rolling_batch_prefill_size": None, "sequence_parallel": None,
    "attention_backend": None, "use_custom_all_reduce": None, "max_num_tokens": None, "max_output_len": None,
    "neuron_optimize_level": None, "context_length_estimate": None, "enable_mixed_precision_accumulation": None,
    # model and tokenizer loading
    "tokenizer": None, "tokenizer_mode": None, "tokenizer_revision": None, "skip_tokenizer_init": None,
    "code_revision": None, "download_dir": None, "load_format": None, "config_format": None, "hf_overrides": None,
    "rope_scaling": None, "rope_theta": None, "model_loader_extra_config": None, "ignore_patterns": None,
    "hf_token": None, "pt_load_map_location": None, "use_tqdm_on_load": None,
    "override_generation_config": None, "override_neuron_config": None, "override_pooler_config": None,
    "additional_config": None, "seed": None, "max_logprobs": None, "logits_processor_pattern": None,
    "guided_decoding_backend": None, "structured_outputs_config": None,
    # multimodal and pooling
    "mm_processor_kwargs": None, "disable_mm_preprocessor_cache": None, "pooler_config": None, "runner": None,
    "convert": None,
    # serving front ends
    "host": None, "port": None, "uvicorn_log_level": None, "disable_log_requests": None, "max_log_len": None,
    "ssl_keyfile": None, "ssl_certfile": None, "allowed_origins": None, "root_path": None, "middleware": None,
    "enable_request_id_headers": None, "disable_fastapi_docs": None, "enable_prompt_tokens_details": None,
    "return_tokens_as_token_ids": None, "enable_server_load_tracking": None, "otlp_traces_endpoint": None,
    "collect_detailed_traces": None, "worker_cls": None, "worker_extension_cls": None,
}

# options of ours that are gone: key -> why, logged once at start-up when a configuration still sets one
RETIRED_OPTIONS: dict[str, str] = {
    "batch_invariant": "every kernel backend computes each row alone, so a sequence's logits never depend on "
                       "its batch (there is no faster non-invariant form left to choose)",
}

# difflib ratio at or above which an unknown key counts as a misspelling of the nearest known name
CLOSE_MATCH_CUTOFF = 0.8


class Kind(str, enum.Enum):
    OURS = "ours"              # a Settings field
    FRONT_END = "front_end"    # DJL Serving's own key: passed through quietly
    FOREIGN = "foreign"        # another engine's option: logged at start-up
    RETIRED = "retired"        # an option of ours that is gone (RETIRED_OPTIONS): logged at start-up
    MISSPELT = "misspelt"      # nearest known name is one of ours: refused
    UNKNOWN = "unknown"        # nothing near it: logged at start-up


def sort_key(key: str, ours: Iterable[str]) -> tuple[Kind, str | None]:
    """What `key` (lower case) is, and the name that goes with it: for FOREIGN the key of ours that does its
    job (or None), for MISSPELT the nearest field of ours, for UNKNOWN the nearest known foreign name (or None),
    for RETIRED why it is gone.

    A close match is looked for among all known names at once, so a misspelt vLLM option (max_num_seq) is not
    taken for a misspelt one of ours."""
    ours = frozenset(ours)
    if key in ours:
        return Kind.OURS, None
    if key in FRONT_END_KEYS or key.startswith(("gpu.", "cpu.", "neuron.")):
        return Kind.FRONT_END, None
    if key in FOREIGN_OPTIONS:
        return Kind.FOREIGN, FOREIGN_OPTIONS[key]
    if key in RETIRED_OPTIONS:
        return Kind.RETIRED, RETIRED_OPTIONS[key]
    nearest = difflib.get_close_matches(key, [*ours, *FRONT_END_KEYS, *FOREIGN_OPTIONS], n=1,
                                        cutoff=CLOSE_MATCH_CUTOFF)
    if nearest and nearest[0] in ours:
        return Kind.MISSPELT, nearest[0]
    return Kind.UNKNOWN, nearest[0] if nearest else None
