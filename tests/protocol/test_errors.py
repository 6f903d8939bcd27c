"""protocol/errors.py: each dialect's error object behind error_body, the typed validation error, and every
error text encodable (safe_text) whatever the client's value held."""
from __future__ import annotations

import json

import pytest

from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, RequestValidationError, error_body, safe_text
from lmi_handler.protocol.formatters import stream_failure
from tests.protocol.helpers import make_plan


def test_lmi_errors_are_error_and_code():
    assert error_body(Dialect.LMI, "bad", 400, "top_p") == {"error": "bad", "code": 400}
    assert error_body(Dialect.LMI, "busy", 503) == {"error": "busy", "code": 503}


@pytest.mark.parametrize("code, kind", [(400, "invalid_request_error"), (404, "invalid_request_error"),
                                        (413, "invalid_request_error"), (GENERATION_ERROR_CODE, "server_error"),
                                        (500, "server_error"), (503, "server_error"), (504, "server_error")])
def test_openai_errors_are_invalid_requests_below_424_and_server_errors_from_it(code, kind):
    assert error_body(Dialect.OPENAI, "m", code, "n") == {"error": {"message": "m", "type": kind, "param": "n",
                                                                    "code": code}}


def test_tgi_errors_say_generation_once_generation_failed_and_keep_the_status_for_refusals():
    """TGI's clients raise by error_type when it is there (GenerationError), else by the HTTP status
    (400: BadRequestError, which text-generation's own client test expects for max_new_tokens=0)."""
    assert error_body(Dialect.TGI, "boom", GENERATION_ERROR_CODE) == {"error": "boom", "error_type": "generation"}
    assert error_body(Dialect.TGI, "boom", 504) == {"error": "boom", "error_type": "generation"}
    assert error_body(Dialect.TGI, "bad", 400, "max_new_tokens") == {"error": "bad", "code": 400}


def test_a_range_error_names_the_field_the_rule_and_the_value_as_sent():
    err = RequestValidationError.out_of_range("top_p", True, "a number in (0, 1]")
    assert (err.field, err.status_code) == ("top_p", 400)
    assert err.message == "Invalid parameter `top_p`: must be a number in (0, 1], got true"


@pytest.mark.parametrize(("text", "expected"), [
    ("\ud800", "\\ud800"), ("a\udfffb", "a\\udfffb"), ("\ude00\ud83d", "\\ude00\\ud83d"),
    ("é 😀 日本", "é 😀 日本"), ("", ""), ("tab\tnewline\n", "tab\tnewline\n"),
])
def test_safe_text_escapes_lone_surrogates_and_keeps_everything_else(text, expected):
    assert safe_text(text) == expected
    safe_text(text).encode("utf-8")


def test_a_validation_error_echoing_a_lone_surrogate_is_encodable_in_every_error_shape():
    err = RequestValidationError("\ud800field", "The model `\ud800` does not exist", status_code=404)
    assert err.message == str(err) == "The model `\\ud800` does not exist" and err.field == "\\ud800field"
    for dialect in Dialect:
        for code in (404, GENERATION_ERROR_CODE):
            assert "\\\\ud800" in encode_bytes(error_body(dialect, err.message, code, err.field)).decode("utf-8")
    raw = error_body(Dialect.OPENAI, "bad \udc80", 400, param="\udc80")      # a message built elsewhere, not yet safe
    assert json.loads(encode_bytes(raw)) == {"error": {"message": "bad \\udc80", "type": "invalid_request_error",
                                                      "param": "\\udc80", "code": 400}}


def test_a_stream_failure_line_echoing_a_lone_surrogate_is_encodable():
    (line,) = stream_failure("inference failed: \ud800", GENERATION_ERROR_CODE, make_plan())
    assert line["error"] == "inference failed: \\ud800" and line["details"]["finish_reason"] == "error"
    encode_bytes(line)


def test_out_of_range_shows_nan_nested_values_surrogate_keys_and_huge_ints_without_failing():
    nested = RequestValidationError.out_of_range("stop", {"\ud800": [float("nan"), float("inf")]}, "a string")
    assert nested.message.endswith("got {'\\ud800': [nan, inf]}")
    huge = RequestValidationError.out_of_range("seed", 10 ** 5000, "an int64")
    assert huge.message.endswith("got an integer of about 5001 digits")
    for err in (nested, huge):
        encode_bytes(error_body(Dialect.LMI, err.message, 400))
