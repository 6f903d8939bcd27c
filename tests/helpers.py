"""Paths, loaders and the server subprocess shared by every test package (and benchmarks/bench.py);
conftest modules only hold fixtures."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model"
CASES_DIR = REPO / "tests" / "cases"                       # copies of ../shared/cases
MT_BENCH = REPO / "benchmarks" / "data" / "mt_bench_questions.jsonl"   # a copy of ../shared/data's
# The originals the copies come from: ../shared beside the checkout (LMI_SHARED_DIR points elsewhere);
# only tests/test_repository.py reads it, to check that the copies still match.
SHARED = Path(os.environ.get("LMI_SHARED_DIR") or REPO.parent / "shared")
# The KV cache of the models the tests hold in their own process (option.kv_cache_bytes; the default 1 GiB is
# touched at start-up): several of them at once must fit a shared 2-core, 24 GiB machine.
SMALL_KV_CACHE_BYTES = 256 << 20


def load_case(case_id: str) -> dict:
    """A request case from tests/cases (real bug reports against similar servers; README there)."""
    return json.loads((CASES_DIR / f"{case_id}.json").read_text())


def mt_bench_questions() -> list[str]:
    """First turns of the MT-Bench questions, in file order."""
    return [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines() if line.strip()]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's child process (Linux): SIGTERM it when the process that started it dies, so a test run
    that is killed (a timeout, the OOM killer) leaves no server behind. Elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerProcess:
    """`lmi-handler serve` in a subprocess on a free loopback port; `url` is its base address. Use it as a
    context manager (it waits for /ping, then stops the server on exit).

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
            cwd=properties.parent, env=environ, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent)

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


def server_process(tmp_path_factory, name: str, env: dict[str, str] | None = None, **options: str) -> ServerProcess:
    """A (not yet started) server on the repo's serving.properties with OPTION_* overrides `options` and extra
    `env`, its log in a fresh logs folder as `<name>.log`; start it with `with` (or __enter__)."""
    log_path = tmp_path_factory.mktemp("logs") / f"{name}.log"
    return ServerProcess(options, log_path, REPO / "serving.properties", env=env)


def serve(tmp_path_factory, name: str, **options: str):
    """Start a server with OPTION_* overrides of the repo's serving.properties; yields it, then stops it
    (for fixtures: `yield from serve(...)`)."""
    with server_process(tmp_path_factory, name, **options) as server:
        yield server


# JSON schemas with nested objects, arrays, enums and required keys, and what to ask each for (structured output)
SCHEMA_SUBJECTS = ["a fictional person", "a city", "a book", "a recipe", "a laptop", "a movie", "a company", "a planet"]
JSON_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                      "rating": {"enum": ["good", "bad", "average"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["title", "rating", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "location": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                                      "population": {"type": "integer", "minimum": 0}},
                     "required": ["country"], "additionalProperties": False}},
     "required": ["name", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "kind": {"enum": ["small", "large"]}},
        "required": ["name", "kind"], "additionalProperties": False}}, "ok": {"type": "boolean"}},
     "required": ["items", "ok"], "additionalProperties": False},
]


# Tools for the tool-calling tests (docs/tools.md): enums and bounded strings, so the demo model's constrained
# arguments end within a few tokens
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}},
                   "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME_PARAMETERS}}]
TOOL_PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
