"""ServerProcess: `lmi-handler serve` in a subprocess on a free loopback port (tests, benchmarks).

Owns starting, waiting for /ping and stopping; what the server does is app.py's.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A running `lmi-handler serve`; `url` is its base address. Use it as a context manager.

    `options` become OPTION_<KEY> environment variables (LMI), overriding `properties`;
    `env` adds other variables (e.g. OMP_NUM_THREADS). Output goes to `log_path`.
    """

    def __init__(self, options: dict[str, str], log_path: Path, properties: Path,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environ = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
        environ.update({f"OPTION_{k.upper()}": v for k, v in options.items()})
        environ.update(env or {})
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmi_handler.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--properties", str(properties)],
            cwd=properties.parent, env=environ, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180) -> float:
        """Seconds until /ping answered 200. Raises RuntimeError if the server exits or times out."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ping", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
        self.log.close()

    def __enter__(self) -> "ServerProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
