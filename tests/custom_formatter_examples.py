"""model.py files for the custom formatter tests: LMI's documented examples (djl-serving's
input_formatter_schema.md and output_formatter_schema.md), with the imports, marks and signatures its docs
show, and a few of our own (a failing formatter, a broken model.py, our own decorators)."""
from __future__ import annotations

# Input formatter, LMI's base model example (vLLM form): a custom `inputPrompt` field becomes `inputs`, and
# max_new_tokens defaults to 256.
LMI_INPUT_EXAMPLE = '''
from djl_python.input_parser import input_formatter

@input_formatter
def custom_input_formatter(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    """Base model input formatter: applies to every request."""
    if "inputPrompt" in decoded_payload:
        decoded_payload["inputs"] = decoded_payload.pop("inputPrompt")
    if "parameters" not in decoded_payload:
        decoded_payload["parameters"] = {}
    decoded_payload["parameters"].setdefault("max_new_tokens", 256)
    return decoded_payload
'''

# Input formatter, LMI's adapter example: the adapter's own model.py prefixes the prompt and sets defaults.
LMI_ADAPTER_INPUT_EXAMPLE = '''
from djl_python.input_parser import input_formatter

@input_formatter
def custom_input_formatter(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    """Adapter input formatter: only for requests naming this adapter."""
    if "inputs" in decoded_payload:
        decoded_payload["inputs"] = f"[ADAPTER_PREFIX] {decoded_payload['inputs']}"
    if "parameters" not in decoded_payload:
        decoded_payload["parameters"] = {}
    decoded_payload["parameters"].setdefault("temperature", 0.7)
    decoded_payload["parameters"].setdefault("max_new_tokens", 512)
    return decoded_payload
'''

# Output formatter, LMI's RequestOutput example ("other backends"): one JSON line per token, the last one
# with the finish reason.
LMI_OUTPUT_EXAMPLE = '''
from djl_python.request_io import TextGenerationOutput
from djl_python.output_formatter import output_formatter
import json

@output_formatter
def custom_output_formatter(request_output: TextGenerationOutput) -> str:
    """One line per generated token."""
    best_sequence = request_output.sequences[request_output.best_sequence_index]
    next_token, is_first_token, is_last_token = best_sequence.get_next_token()
    result = {}
    if next_token:
        result = {"token_id": next_token.id, "token_text": next_token.text, "token_log_prob": next_token.log_prob}
    if is_last_token:
        result["finish_reason"] = best_sequence.finish_reason
    return json.dumps(result) + "\\n"
'''

# Output formatter, LMI's vLLM example (dict form): the answer object gains fields and a prefixed text.
LMI_DICT_OUTPUT_EXAMPLE = '''
from djl_python.output_formatter import output_formatter
import time

@output_formatter
def custom_output_formatter(response_data: dict) -> dict:
    """Base model output formatter: marks the answer and prefixes its text."""
    if 'generated_text' in response_data:
        response_data['custom_formatter_applied'] = True
        response_data['formatter_timestamp'] = int(time.time())
        generated_text = response_data['generated_text']
        response_data['original_length'] = len(generated_text)
        response_data['generated_text'] = f"[BASE] {generated_text}"
    return response_data
'''

# Output formatter, LMI's adapter example (dict form): the adapter's answers carry its name and metrics.
LMI_ADAPTER_DICT_OUTPUT_EXAMPLE = '''
from djl_python.output_formatter import output_formatter
import json

@output_formatter
def custom_output_formatter(response_data: dict) -> dict:
    """Adapter output formatter: only for requests naming this adapter."""
    if 'generated_text' in response_data:
        response_data['adapter_name'] = 'my_adapter'
        response_data['adapter_version'] = '1.0'
        generated_text = response_data['generated_text']
        response_data['generated_text'] = f"[ADAPTER] {generated_text}"
        response_data['custom_metrics'] = {
            'text_length': len(generated_text),
            'word_count': len(generated_text.split())
        }
    return response_data
'''

# LMI's own failing example (djl-serving's integration tests): an input formatter that always raises.
FAILING_INPUT = '''
from djl_python.input_parser import input_formatter

@input_formatter
def custom_input_formatter(decoded_payload, **kwargs):
    raise RuntimeError("Input formatter intentionally failed")
'''

# Ours: an output formatter that fails for prompts that ask it to, written with this package's decorators.
FAILING_OUTPUT_OURS = '''
from lmi_handler.output_formatter import output_formatter

@output_formatter
def picky_formatter(request_output):
    if "fail" in request_output.input.input_text:
        raise ValueError("this prompt asked me to fail")
    token, _, _ = request_output.sequences[request_output.best_sequence_index].get_next_token()
    return token.text.upper() if token else ""
'''

# Ours: LMI's input example's rename, and a failure for bodies that ask for one.
PICKY_INPUT_OURS = '''
from lmi_handler.input_parser import input_formatter

@input_formatter
def picky_input(decoded_payload, tokenizer=None, **kwargs):
    if decoded_payload.get("fail"):
        raise ValueError("this body asked me to fail")
    decoded_payload["inputs"] = decoded_payload.pop("inputPrompt")
    assert tokenizer.encode("hello")                     # LMI's vLLM form passes the tokenizer
    return decoded_payload
'''

# Ours: an unmarked function that option.output_formatter names.
NAMED_OUTPUT = '''
def shout(request_output):
    token, first, last = request_output.sequences[0].get_next_token()
    text = (token.text if token else "").upper()
    return ("<" if first else "") + text + (">" if last else "")
'''

BROKEN = '''
import json
import not_a_module_anywhere
'''
