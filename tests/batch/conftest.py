"""Batch test fixtures: the demo model in-process (one Service per session) and JSONL helpers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, ServerProcess

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
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


@pytest.fixture(scope="session")
def service(model_dir):
    from lmi_handler.config import Settings, read_serving_properties
    from lmi_handler.service import Service

    properties = read_serving_properties(REPO / "serving.properties", environ={})
    return Service(Settings.from_properties(properties))


@pytest.fixture(scope="session")
def runner(service):
    from lmi_handler.batch.runner import BatchRunner

    return BatchRunner(service)


def start(tmp_path_factory, batch_dir, name: str) -> ServerProcess:
    """A server on the repo's serving.properties with its batch state in `batch_dir` (use with `with`)."""
    log = tmp_path_factory.mktemp("logs") / f"{name}.log"
    return ServerProcess({"batch_dir": str(batch_dir), "num_threads": "1",
                          "batch_max_file_bytes": str(MAX_FILE_BYTES)}, log, REPO / "serving.properties")


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    with start(tmp_path_factory, tmp_path_factory.mktemp("batches"), "batch-api") as running:
        yield running


@pytest.fixture(scope="session")
def sdk(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
