"""Helpers shared by the HTTP tests: small client calls, the real app in this process (InProcessServer),
replies of concurrent callers, generated bad bodies (hypothesis strategies). Nothing mocked.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import httpx
import pytest
from hypothesis import strategies as st

from lmi_handler.config import read_serving_properties
from lmi_handler.server.app import create_app
from tests.helpers import REPO, ServerProcess, server_process


def invoke(client: httpx.Client, inputs, **parameters) -> httpx.Response:
    return client.post("/invocations", json={"inputs": inputs, "parameters": parameters})


def generated_text(client: httpx.Client, inputs, **parameters) -> str:
    response = invoke(client, inputs, **parameters)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def stream_lines(client: httpx.Client, body: dict) -> list[dict]:
    """POST with stream=true and parse the jsonlines body line by line as it arrives."""
    lines = []
    with client.stream("POST", "/invocations", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("application/jsonlines")
        for line in response.iter_lines():
            if line.strip():
                lines.append(json.loads(line))
    return lines


def streamed_text(lines: list[dict]) -> str:
    return "".join(line["token"]["text"] for line in lines)


PROMPT = "The capital of France is"


def solo_text(server, prompt: str = PROMPT, max_new_tokens: int = 8) -> str:
    """A greedy /invocations answer of `server` (a ServerProcess) to `prompt`, alone."""
    with httpx.Client(base_url=server.url, timeout=300) as http:
        return generated_text(http, prompt, max_new_tokens=max_new_tokens, do_sample=False)


class InProcessServer:
    """create_app() with its lifespan running on a private event loop; post() sends one request."""

    def __init__(self, **options: str):
        properties = read_serving_properties(REPO / "serving.properties", environ={})
        # engine_dead_exit_s 0: an engine dying in-process must fail its test, never end the test run (os._exit)
        self.app = create_app({**properties, "max_rolling_batch_size": "4", "engine_dead_exit_s": "0", **options})
        self.loop = asyncio.new_event_loop()
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://app",
                                        timeout=300)

    @property
    def service(self):
        """The app's loaded Service (app.state.service)."""
        return self.app.state.service

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(path, **kwargs))

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.client.get(path, **kwargs))

    def gather(self, *requests) -> list[httpx.Response]:
        """Run coroutines made with self.client concurrently (e.g. several posts at once)."""
        async def run():
            return await asyncio.gather(*requests)
        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.lifespan.__aexit__(None, None, None))
        self.loop.close()


@contextmanager
def fresh_server(**options: str) -> Iterator[InProcessServer]:
    """An InProcessServer of its own (its own Handler and model, like a fresh worker), closed on exit."""
    server = InProcessServer(**options)
    try:
        yield server
    finally:
        server.close()


TGI_PYTHON = REPO / ".venv-tgi" / "bin" / "python"


def run_tgi_client(url: str, prompt: str, max_new_tokens: int, api_key: str | None = None) -> dict:
    """The real TGI client (text-generation, its own venv: it pins huggingface-hub<1.0) against `url`:
    clients/tgi_client.py's JSON document of what it got back; `api_key` goes in the client's headers."""
    if not TGI_PYTHON.is_file():
        pytest.fail("the TGI client's venv is missing: run `make test` (it creates .venv-tgi)")
    script = REPO / "tests" / "server" / "clients" / "tgi_client.py"
    run = subprocess.run([str(TGI_PYTHON), str(script), url, prompt, str(max_new_tokens), *filter(None, [api_key])],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def start_server(tmp_path_factory, name: str, env: dict[str, str] | None = None, **options: str) -> ServerProcess:
    """A started `lmi-handler serve` (OPTION_* overrides, extra env); the caller stops it."""
    return server_process(tmp_path_factory, name, env, **{"num_threads": "1", **options}).__enter__()


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def wait_until(check, timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until check() is true; AssertionError after timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if check():
            return time.monotonic() - start
        time.sleep(poll_s)
    raise AssertionError(f"not true within {timeout_s} s")


def idle(client: httpx.Client, kv_used: float = 0) -> bool:
    return (metric(client, "lmi_requests_running") == 0 and metric(client, "lmi_requests_waiting") == 0
            and metric(client, "lmi_front_end_queue_depth") == 0 and metric(client, "lmi_kv_cache_blocks_used") == kv_used)


@dataclass
class Reply:
    """One response as a client saw it: status, seconds from sending to the status line and to the end."""

    status: int = 0
    headers: dict = field(default_factory=dict)
    head_s: float = 0.0
    total_s: float = 0.0
    body: bytes = b""
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    def json(self):
        return json.loads(self.body)

    @property
    def events(self) -> list[dict]:
        """Parsed stream lines (jsonlines or `data:` SSE lines; [DONE] left out)."""
        out = []
        for line in self.lines:
            line = line[len("data:"):].strip() if line.startswith("data:") else line.strip()
            if line and line != "[DONE]":
                out.append(json.loads(line))
        return out


def send(url: str, path: str, body: dict, headers: dict | None = None, timeout_s: float = 300,
         stream: bool = False, http: httpx.Client | None = None) -> Reply:
    """POST and read the whole answer, timing the status line and the end (`http`: a client built
    beforehand, closed here; building one costs CPU, so it happens before the clock starts)."""
    reply = Reply()
    http = http or httpx.Client(base_url=url, timeout=timeout_s)
    start = time.monotonic()
    try:
        with http:
            with http.stream("POST", path, json=body, headers=headers or {}) as response:
                reply.status, reply.headers = response.status_code, dict(response.headers)
                reply.head_s = time.monotonic() - start
                if stream and response.status_code == 200:
                    reply.lines = [line for line in response.iter_lines() if line.strip()]
                else:
                    reply.body = response.read()
    except httpx.HTTPError as exc:
        reply.error = repr(exc)
    reply.total_s = time.monotonic() - start
    return reply


def send_all(url: str, calls: list[dict]) -> list[Reply]:
    """Send each call (send()'s keyword arguments: path, body, headers, stream) from its own thread,
    all released together; returns the replies in the calls' order."""
    replies: list[Reply | None] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int, call: dict, http: httpx.Client) -> None:
        barrier.wait()
        replies[i] = send(url, **call, http=http)

    clients = [httpx.Client(base_url=url, timeout=call.get("timeout_s", 300)) for call in calls]
    threads = [threading.Thread(target=run, args=(i, call, http)) for i, (call, http) in enumerate(zip(calls, clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return replies  # type: ignore[return-value]


LMI_ROUTES = ("/invocations", "/generate", "/generate_stream", "/")


OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")


ROUTES = LMI_ROUTES + OPENAI_ROUTES


# Length fields never take a valid large value (that would be a long generation, not a bad body).
LENGTH_FIELDS = {"max_new_tokens", "max_tokens", "max_completion_tokens"}


BAD_LENGTHS = [0, -1, -(2 ** 63), 2 ** 63, 2 ** 64, 10 ** 30, 1.5, "3", True, [], {}, 100_000]


PARAMETER_FIELDS = ["do_sample", "seed", "temperature", "repetition_penalty", "top_k", "top_p", "max_new_tokens",
                    "details", "return_full_text", "stop_sequences", "stop", "decoder_input_details", "min_p",
                    "presence_penalty", "frequency_penalty", "ignore_eos", "stop_token_ids",
                    "include_stop_str_in_output", "logprobs", "top_n_tokens", "skip_special_tokens", "typical_p",
                    "truncate", "n", "best_of", "num_beams"]


OPENAI_FIELDS = ["model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "n", "stream", "stream_options", "stop", "seed", "max_tokens", "ignore_eos",
                 "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "user", "logprobs",
                 "top_logprobs", "max_completion_tokens", "echo", "best_of"]


# Every bound the schema has, and just past it, plus values of the wrong JSON type.
BOUNDS = [0, 1, -1, -2, 2, 20, 21, 16, 17, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, -(2 ** 63), 2 ** 63, -(2 ** 63) - 1,
          0.0, -0.0, 1e-5, 1e-6, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -2.0000001, 1e308, -1e308, 5e-324]


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(BOUNDS),
                    st.text(max_size=20), st.sampled_from(["", " ", "\x00", "\ud800", "é" * 3, "1", "true", "null"]))


values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5),
                                                                                           inner, max_size=3),
                      max_leaves=8)


def base_body(route: str, stream: bool = False) -> dict:
    if route == "/v1/chat/completions":
        return {"model": "model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": stream}
    if route == "/v1/completions":
        return {"model": "model", "prompt": "Hi", "max_tokens": 1, "stream": stream}
    return {"inputs": "Hi", "parameters": {"max_new_tokens": 1}, "stream": stream}


@st.composite
def field_mutations(draw, route: str) -> bytes:
    """A valid body of `route` with one field set to a drawn value (a wrong type, a bound, huge, empty)."""
    body = base_body(route, stream=draw(st.booleans()))
    openai = route in OPENAI_ROUTES
    target = body if openai else body["parameters"]
    name = draw(st.sampled_from(OPENAI_FIELDS if openai else PARAMETER_FIELDS))
    value = draw(st.sampled_from(BAD_LENGTHS)) if name in LENGTH_FIELDS else draw(values)
    target[name] = value
    return json.dumps(body).encode()


@st.composite
def shape_mutations(draw, route: str) -> bytes:
    """The body's own shape broken: a top-level key replaced, removed or added; inputs/messages/prompt bad."""
    body = base_body(route)
    key = draw(st.sampled_from(sorted(body) + ["parameters", "inputs", "messages", "prompt", "extra"]))
    action = draw(st.sampled_from(["set", "drop"]))
    if action == "drop":
        body.pop(key, None)
    elif key in LENGTH_FIELDS:        # OpenAI bodies keep max_tokens at the top level
        body[key] = draw(st.sampled_from(BAD_LENGTHS))
    elif key == "messages":
        body[key] = draw(st.one_of(values, st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]),
                                                                     values, max_size=3), max_size=3)))
    else:
        body[key] = draw(values)
    if route == "/v1/chat/completions" and "max_tokens" not in body:   # else: the rest of the context
        body["max_tokens"] = 1
    if route in LMI_ROUTES and "parameters" not in body:              # else: 30 tokens
        body["parameters"] = {"max_new_tokens": 1}
    elif route in LMI_ROUTES and isinstance(body["parameters"], dict):
        body["parameters"].setdefault("max_new_tokens", 1)
    return json.dumps(body).encode()


huge_inputs = st.sampled_from([b'{"inputs": "' + b"a" * (9 << 20) + b'"}',               # over 8 MiB: 413
                               json.dumps({"inputs": "hello " * 20000, "parameters": {"max_new_tokens": 1}}).encode(),
                               json.dumps({"inputs": "", "parameters": {"max_new_tokens": 1}}).encode(),
                               json.dumps({"inputs": ["Hi"] * 3, "parameters": {"max_new_tokens": 1}}).encode(),
                               b"", b"{}", b"[]", b"null", b'"Hi"', b"0", b"{", b'{"inputs": "\\ud800"}'])


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# Bytes that are not JSON or not UTF-8; a text/plain body is the prompt itself (LMI), so it is sent only
# when invalid UTF-8 (a valid one would be a real 30-token generation, not a bad body).
json_bytes = st.one_of(st.binary(max_size=64).map(lambda b: (b, "application/json")),
                       st.binary(min_size=1, max_size=16).map(
                           lambda b: (b'{"inputs": "' + b + b'", "parameters": {"max_new_tokens": 1}}', None)),
                       st.binary(min_size=1, max_size=8).map(lambda b: (
                           b'{"inputs": "Hi", "parameters": {"max_new_tokens": 1, "stop": "' + b + b'"}}', None)))


plain_bytes = st.binary(min_size=1, max_size=64).filter(_invalid_utf8).map(lambda b: (b, "text/plain"))


def bad_bodies(route: str):
    """(body bytes, content type or None) pairs for `route`."""
    as_json = st.tuples(st.one_of(field_mutations(route), shape_mutations(route), huge_inputs),
                        st.sampled_from(["application/json", None]))
    return st.one_of(as_json, json_bytes, plain_bytes)


def nested(depth: int, route: str) -> bytes:
    """A valid body of `route` with an ignored key holding arrays nested `depth` deep."""
    body = json.dumps(base_body(route))
    return (body[:-1] + ', "ignored": ' + "[" * depth + "]" * depth + "}").encode()


def nested_in_field(depth: int, route: str) -> bytes:
    """Nesting where the schema looks: under `parameters` (LMI) or `messages` (chat) or `stop`."""
    deep = "[" * depth + "]" * depth
    if route == "/v1/chat/completions":
        return ('{"messages": ' + deep + ', "max_tokens": 1}').encode()
    if route == "/v1/completions":
        return ('{"prompt": "Hi", "max_tokens": 1, "stop": ' + deep + "}").encode()
    return ('{"inputs": "Hi", "parameters": {"max_new_tokens": 1, "stop_sequences": ' + deep + "}}").encode()


# ---- values JSON and UTF-8 cannot carry back (issue 15) --------------------------------------------

# Lone surrogates: JSON's "\ud800" escapes are legal, but no UTF-8 text holds them; so a message echoing
# one cannot be sent unless it escapes it. NaN and Infinity: Python's json reads them, standard JSON
# has no such literals. Numbers past float range, or past Python's 4300-digit int limit. Nesting past
# the 512 levels the server reads.
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
bad_texts = st.one_of(surrogates, st.tuples(st.text(max_size=4), surrogates, st.text(max_size=4)).map("".join),
                      st.sampled_from(["\ud800", "\udfff", "model\udc80", "\ud83d", "\ude00\ud83d", "Hi\ud800"]))
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "9" * 4301, "-" + "7" * 5000,
               "1e-999", "18446744073709551616", "-9223372036854775809"]


class Raw:
    """JSON text placed as it is (json.dumps cannot write a 5000-digit int or 600 levels cheaply)."""

    def __init__(self, text: str):
        self.text = text


raw_numbers = st.sampled_from(RAW_NUMBERS).map(Raw)


@st.composite
def deep_values(draw) -> Raw:
    """A value nested 1-700 levels deep (arrays or objects) around a number or text JSON cannot carry."""
    depth = draw(st.integers(min_value=1, max_value=700))
    leaf = draw(st.sampled_from(RAW_NUMBERS + ['"\\ud800"', '{"\\udfff": NaN}']))
    if draw(st.booleans()):
        return Raw("[" * depth + leaf + "]" * depth)
    return Raw('{"a": ' * depth + leaf + "}" * depth)


poison_leaves = st.one_of(bad_texts, raw_numbers, st.sampled_from([float("nan"), float("inf"), float("-inf"),
                                                                   1e308, -1e308, 2 ** 64, -(2 ** 63) - 1]))
poison = st.one_of(deep_values(), st.recursive(
    poison_leaves, lambda inner: st.lists(inner, min_size=1, max_size=3)
    | st.dictionaries(st.one_of(bad_texts, st.text(max_size=4)), inner, min_size=1, max_size=3), max_leaves=6))


def dump(body) -> bytes:
    """`body` as JSON bytes (ASCII: lone surrogates become \\uXXXX escapes), NaN/Infinity and Raw text as is."""
    raws: list[str] = []

    def place(value):
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {key: place(item) for key, item in value.items()}
        if isinstance(value, list):
            return [place(item) for item in value]
        return value

    text = json.dumps(place(body), ensure_ascii=True, allow_nan=True)
    for index, raw in enumerate(raws):
        text = text.replace(f'"@@raw{index}@@"', raw, 1)
    return text.encode("ascii")


def _containers(body: dict, route: str) -> list[tuple[dict, list[str]]]:
    """The objects of a valid body a poison may go into, each with the field names that matter there."""
    found = [(body, OPENAI_FIELDS + ["messages", "prompt"] if route in OPENAI_ROUTES
              else ["inputs", "parameters", "stream", "messages", "model"])]
    if isinstance(body.get("parameters"), dict):
        found.append((body["parameters"], PARAMETER_FIELDS))
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        found.append((messages[0], ["role", "content", "name"]))
    return found


@st.composite
def unencodable_bodies(draw, route: str) -> bytes:
    """A valid one-token body of `route` with 1-3 values (or keys) JSON and UTF-8 cannot carry, at any depth:
    a field (a known one or a new key, itself perhaps a lone surrogate) set to a poison value."""
    body = base_body(route, stream=draw(st.booleans()))
    if route == "/invocations" and draw(st.booleans()):          # LMI's chat schema on /invocations
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": body["stream"]}
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        container, names = draw(st.sampled_from(_containers(body, route)))
        key = draw(st.one_of(st.sampled_from(names), bad_texts))
        container[key] = draw(poison)
    if route in LMI_ROUTES and isinstance(body.get("parameters"), dict):   # else a 30-token answer
        body["parameters"].setdefault("max_new_tokens", 1)
    return dump(body)
