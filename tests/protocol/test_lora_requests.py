"""The request fields that name a LoRA adapter: /invocations `adapters` (one name, or one per input) and
TGI's parameters.adapter_id, checked at the edge."""
import pytest

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.invocations import InvocationRequest


def test_adapters_is_one_name_or_one_name_per_input():
    assert InvocationRequest.parse({"inputs": "hi", "adapters": "sql"}).adapters == "sql"
    listed = InvocationRequest.parse({"inputs": ["a", "b"], "adapters": ["sql", "chat"]})
    assert listed.adapters == ["sql", "chat"]
    chat = InvocationRequest.parse({"messages": [{"role": "user", "content": "hi"}], "adapters": "sql"})
    assert chat.adapters == "sql" and chat.chat is not None


@pytest.mark.parametrize("body, allowed", [
    ({"inputs": ["a", "b"], "adapters": ["sql"]}, "a list of 2 names (one per input)"),
    ({"inputs": "hi", "adapters": ["sql"]}, "a non-empty adapter name, got"),
    ({"inputs": "hi", "adapters": ""}, "a non-empty adapter name"),
    ({"inputs": "hi", "adapters": 3}, "a non-empty adapter name"),
])
def test_a_bad_adapters_field_is_refused_naming_it(body, allowed):
    with pytest.raises(RequestValidationError, match="adapters") as err:
        InvocationRequest.parse(body)
    assert allowed in str(err.value) and err.value.status_code == 400


def test_tgi_adapter_id_is_a_non_empty_string():
    assert InvocationRequest.parse({"inputs": "hi", "parameters": {"adapter_id": "sql"}}).parameters.adapter_id == "sql"
    with pytest.raises(RequestValidationError, match="adapter_id"):
        InvocationRequest.parse({"inputs": "hi", "parameters": {"adapter_id": ""}})
