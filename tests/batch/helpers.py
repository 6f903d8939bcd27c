"""Batch test helpers: JSONL lines and files, the batch CLI in a subprocess, a batch-API server process,
and the /v1/files + /v1/batches calls through the `openai` package.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO, ServerProcess

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ORDER = ["validating", "in_progress", "finalizing", "completed"]   # a Batch's statuses, in order
MAX_FILE_BYTES = 200_000   # option.batch_max_file_bytes of the test servers (the 413 test)


def batch_line(custom_id: str, body: dict, url: str = CHAT, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def write_jsonl(path: Path, lines: list) -> Path:
    """Write lines (dicts as JSON; plain strings verbatim, as cases/README.md says)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines() if text.strip()] if path.exists() else []


def by_custom_id(records: list[dict]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for record in records:
        assert record["custom_id"] not in found, f"custom_id {record['custom_id']} twice"
        found[record["custom_id"]] = record
    return found


def content(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update(PYTHONPATH=str(REPO), OPTION_NUM_THREADS="1")
    return env


def batch_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lmi_handler.cli", "batch", *args, "--properties", str(REPO / "serving.properties")]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(batch_cli(*args), env=cli_env(), capture_output=True, text=True, timeout=timeout)


def start(tmp_path_factory, batch_dir, name: str) -> ServerProcess:
    """A server on the repo's serving.properties with its batch state in `batch_dir` (use with `with`)."""
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    return ServerProcess({"batch_dir": str(batch_dir), "num_threads": "1",
                          "batch_max_file_bytes": str(MAX_FILE_BYTES)}, log, REPO / "serving.properties")


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(sdk, lines: list):
    return sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")


def poll(sdk, batch_id: str, timeout_s: float = 300, until=("completed", "failed", "cancelled", "expired")):
    """Statuses and request_counts seen every 0.5 s until a terminal status; checks they only move forward."""
    seen, counts = [], []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        seen.append(batch.status)
        counts.append(batch.request_counts)
        if batch.status in until:
            return batch, seen, counts
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {seen[-1]} after {timeout_s} s")


def records(sdk, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(t) for t in sdk.files.content(file_id).text.splitlines() if t.strip()]


def finish_reason(record: dict) -> str:
    return record["response"]["body"]["choices"][0]["finish_reason"]


def completion_tokens(record: dict) -> int:
    return record["response"]["body"]["usage"]["completion_tokens"]


# Lines written as the batch input format's own examples write them: `model` is any id ("for OpenAI
# compatibility"; the server's loaded model answers), here the format's placeholder "m", a foreign model id,
# the served name, and none.
FOREIGN_MODEL = "meta-llama/Meta-Llama-3.1-8B-Instruct"


def format_example_lines() -> list[dict]:
    ask = [{"role": "user", "content": "Name three colors."}]
    return [batch_line("m-chat", {"model": "m", "messages": ask, "max_completion_tokens": 6}),
            batch_line("m-text", {"model": "m", "prompt": "The sky is", "max_tokens": 4}, COMPLETIONS),
            batch_line("foreign", {"model": FOREIGN_MODEL, "messages": ask, "max_tokens": 6, "temperature": 0}),
            batch_line("served", {"model": "model", "messages": ask, "max_completion_tokens": 6}),
            batch_line("no-model", {"messages": ask, "max_completion_tokens": 6})]
