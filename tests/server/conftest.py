"""Real servers for the HTTP tests: `lmi-handler serve` in a subprocess on a free loopback port."""
from __future__ import annotations

import httpx
import pytest

from tests.helpers import REPO, ServerProcess


def serve(tmp_path_factory, name: str, **options: str):
    """Start a server with OPTION_* overrides of the repo's serving.properties; yields it, then stops it."""
    log_path = tmp_path_factory.mktemp("logs") / f"{name}.log"
    with ServerProcess(options, log_path, REPO / "serving.properties") as server:
        yield server


@pytest.fixture(scope="session")
def rolling_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "rolling", max_rolling_batch_size="16")


@pytest.fixture(scope="session")
def dynamic_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "dynamic", rolling_batch="disable")


@pytest.fixture(scope="module")
def tgi_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "tgi", tgi_compat="true")


@pytest.fixture(scope="module")
def sse_server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, "sse", output_formatter="sse")


@pytest.fixture(scope="session")
def client(rolling_server):
    with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
        yield http
