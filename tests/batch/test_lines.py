"""batch/lines.py, the batch-line loop both runners share: lines with a result are skipped, lines that cannot
run get their record at once, and each outcome its record (no model needed)."""
from __future__ import annotations

import json

from lmi_handler.batch.lines import answer_record, lines_to_run, refusal
from lmi_handler.batch.results import ResultFiles, line_key
from lmi_handler.protocol.batch_lines import BatchDefaults, BatchLine, check_lines
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.errors import RequestValidationError, error_body
from tests.batch.helpers import CHAT, batch_line

ASK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def checked(*lines) -> list:
    texts = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    return list(check_lines(texts, BatchDefaults()))


def test_lines_with_a_result_are_skipped_and_bad_ones_written_in_file_order(tmp_path):
    items = checked(batch_line("done", ASK), "{broken", batch_line("todo", ASK), batch_line("bad", ASK, method="GET"))
    with ResultFiles(tmp_path / "out.jsonl") as results:
        results.done.add(line_key(items[0]))
        written = []
        to_run = list(lines_to_run(items, results.done, written.append))
    assert [line.custom_id for line in to_run] == ["todo"] and all(isinstance(x, BatchLine) for x in to_run)
    assert [(r["custom_id"], r["error"]["code"]) for r in written] == [(None, "invalid_json"), ("bad", "invalid_method")]


def test_each_outcome_has_its_record_with_the_status_its_body_says():
    (line,) = checked(batch_line("a", ASK, CHAT))
    ok = answer_record(line, "r1", {"object": "chat.completion", "choices": []})
    assert ok["custom_id"] == "a" and ok["response"]["status_code"] == 200 and ok["error"] is None
    failed = answer_record(line, "r2", error_body(Dialect.OPENAI, "generation failed", 424))
    assert failed["response"]["status_code"] == 424 and failed["response"]["body"]["error"]["type"] == "server_error"
    refused = refusal(line, "r3", RequestValidationError("top_p", "Invalid parameter `top_p`", 400))
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "top_p"
    assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"
