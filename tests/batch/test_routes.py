"""batch/routes.py: the /v1/files and /v1/batches routes' checks and OpenAI error answers (a real server).
"""
from __future__ import annotations

import openai
import pytest

from tests.batch.helpers import CHAT, MAX_FILE_BYTES, poll, upload
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
