"""Error objects (protocol/errors.py): every error text is encodable, whatever the client's value held."""
from __future__ import annotations

import json

import pytest

from lmi_handler.protocol.encoder import encode_bytes
from lmi_handler.protocol.errors import RequestValidationError, error_object, lmi_error, openai_error, safe_text
from lmi_handler.protocol.formatters import tgi_error


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
    for body in (lmi_error(str(err), 404), error_object(err.message, 404, openai=True, param=err.field),
                 tgi_error(err.message)):
        assert "\\\\ud800" in encode_bytes(body).decode("utf-8")
    raw = openai_error("bad \udc80", 400, param="\udc80")      # a message built elsewhere, not yet safe
    assert json.loads(encode_bytes(raw)) == {"error": {"message": "bad \\udc80", "type": "invalid_request_error",
                                                      "param": "\\udc80", "code": 400}}


def test_out_of_range_shows_nan_nested_values_surrogate_keys_and_huge_ints_without_failing():
    nested = RequestValidationError.out_of_range("stop", {"\ud800": [float("nan"), float("inf")]}, "a string")
    assert nested.message.endswith("got {'\\ud800': [nan, inf]}")
    huge = RequestValidationError.out_of_range("seed", 10 ** 5000, "an int64")
    assert huge.message.endswith("got an integer of about 5001 digits")
    for err in (nested, huge):
        encode_bytes(lmi_error(err.message, 400))
