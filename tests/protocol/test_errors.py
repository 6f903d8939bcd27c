"""protocol/errors.py: each dialect's error object behind error_body, and the typed validation error."""
from __future__ import annotations

import pytest

from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, RequestValidationError, error_body


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
