"""Real servers for the HTTP tests: `lmi-handler serve` in a subprocess on a free loopback port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A running `lmi-handler serve`; `url` is its base address."""

    def __init__(self, options: dict[str, str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
        env.update({f"OPTION_{k.upper()}": v for k, v in options.items()})
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmi_handler.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--properties", str(REPO / "serving.properties")],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = log_path
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ping", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def rolling_server(model_dir, tmp_path_factory):
    server = Server({"max_rolling_batch_size": "16"}, tmp_path_factory.mktemp("logs") / "rolling.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def dynamic_server(model_dir, tmp_path_factory):
    server = Server({"rolling_batch": "disable"}, tmp_path_factory.mktemp("logs") / "dynamic.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(rolling_server):
    with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
        yield http


@pytest.fixture(scope="module")
def tgi_server(model_dir, tmp_path_factory):
    server = Server({"tgi_compat": "true"}, tmp_path_factory.mktemp("logs") / "tgi.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sse_server(model_dir, tmp_path_factory):
    server = Server({"output_formatter": "sse"}, tmp_path_factory.mktemp("logs") / "sse.log")
    yield server
    server.stop()
