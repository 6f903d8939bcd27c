"""batch/routes.py: the /v1/files and /v1/batches routes' checks and OpenAI error answers (a real server),
files that are not UTF-8 text, and lone surrogates wherever a client can put them.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.batch.helpers import CHAT, MAX_FILE_BYTES, batch_line, poll, upload
from tests.helpers import load_case

pytestmark = pytest.mark.slow


def test_a_bad_batch_level_default_raises_bad_request_naming_it(batch_sdk):
    file_id = upload(batch_sdk, load_case("C21")["request"]["lines"]).id
    with pytest.raises(openai.BadRequestError) as err:
        batch_sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                           extra_body={"temperature": -1})
    assert "temperature" in str(err.value)


def test_uploads_over_the_size_limit_answer_413(batch_sdk):
    with pytest.raises(openai.APIStatusError) as err:
        batch_sdk.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 100_000)), purpose="batch")
    assert err.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        batch_sdk.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")


def test_batches_list_newest_first_with_after_and_limit(batch_sdk):
    file_id = upload(batch_sdk, load_case("C21")["request"]["lines"]).id
    ids = [batch_sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id for _ in range(3)]
    page = batch_sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    after = batch_sdk.batches.list(limit=1, after=ids[2])
    assert [b.id for b in after.data] == [ids[1]]
    for batch_id in ids:
        poll(batch_sdk, batch_id, 120)


# ---- what UTF-8 cannot carry, and files that are not text ----------------------------------------------

def api(batch_server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, batch_server.url + path, timeout=60, **kwargs)


@pytest.mark.parametrize(("data", "line"), [(b'{"custom_id": "a"}\n\xff\xfe\x00binary', 2),
                                            (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", 1),
                                            (b'{"custom_id": "caf\xe9"}\n', 1),      # Latin-1, not UTF-8
                                            (b'{"a": 1}\n{"b": 2}\n\x00\x00', 3),
                                            (b'{"custom_id": "\xe2\x82"}', 1)])      # cut inside a character
def test_an_upload_that_is_not_utf8_text_is_refused_400_naming_its_line(batch_server, data, line):
    response = api(batch_server, "POST", "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and f"line {line}" in error["message"] and "JSONL text" in error["message"]


def test_lone_surrogates_in_ids_metadata_and_custom_ids_never_crash_the_batch_api(batch_server, batch_sdk):
    lines = [json.dumps(batch_line("\ud800-solo", {"prompt": "Hi", "max_tokens": 2}, "/v1/completions")),
             json.dumps(batch_line("plain", {"prompt": "Hi", "max_tokens": 2}, "/v1/completions"))]
    file_id = batch_sdk.files.create(file=("s.jsonl", "\n".join(lines).encode()), purpose="batch").id
    assert "\\ud800" in lines[0]                    # sent as JSON's escape: valid UTF-8 text
    for body in (b'{"input_file_id": "file-\\ud800", "endpoint": "/v1/completions", "completion_window": "24h"}',
                 b'{"input_file_id": "\\udfff", "endpoint": "/v1/completions", "completion_window": "24h"}'):
        missing = api(batch_server, "POST", "/v1/batches", content=body, headers={"content-type": "application/json"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "file_id"
    bad_metadata = ('{"input_file_id": "%s", "endpoint": "/v1/completions", "completion_window": "24h", '
                    '"metadata": {"k\\ud800": "v\\udc00"}}' % file_id).encode()
    refused = api(batch_server, "POST", "/v1/batches", content=bad_metadata, headers={"content-type": "application/json"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"
    for path in ("/v1/files/%ED%A0%80", "/v1/batches/batch_%ED%A0%80", "/v1/files/%ED%A0%80/content"):
        assert api(batch_server, "GET", path).status_code == 404, path
    assert api(batch_server, "GET", "/v1/batches?after=%ED%A0%80").status_code == 200
    assert api(batch_server, "GET", "/v1/files?purpose=%ED%A0%80").status_code == 400
    done, _, _ = poll(batch_sdk, batch_sdk.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                          completion_window="24h").id)
    assert (done.status, done.request_counts.completed) == ("completed", 2)
    raw = api(batch_server, "GET", f"/v1/files/{done.output_file_id}/content").content
    raw.decode("utf-8")                              # the result file is UTF-8 text, the surrogate escaped
    assert {json.loads(text)["custom_id"] for text in raw.splitlines()} == {"\ud800-solo", "plain"}
    unsized = json.dumps(batch_line("\udbff-no-length", {"prompt": "Hi"}, "/v1/completions")).encode()
    failed, _, _ = poll(batch_sdk, batch_sdk.batches.create(
        input_file_id=batch_sdk.files.create(file=("n.jsonl", unsized), purpose="batch").id,
        endpoint="/v1/completions", completion_window="24h").id)
    assert failed.status == "failed" and "\\udbff-no-length" in failed.errors.data[0].message
    assert api(batch_server, "GET", "/v1/batches?limit=100").status_code == 200
