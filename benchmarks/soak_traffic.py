"""Soak traffic: what one request of the mix sends and how its answer is judged against the solo answer.

Owns the routes (every generation route, streaming and not), the actions (plain, n > 1, disconnect, cancel,
deadline, injected fault, a batch job through /v1/files + /v1/batches), answer parsing per dialect and the
verdict of each request (Result.outcome). The schedule of a run, the server and the sampling are soak.py's.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "Once upon a time", "Explain what a CPU does in one sentence.", "The opposite of hot is",
           "Translate 'good morning' to Spanish:", "def fibonacci(n):", "Name a color of the rainbow.",
           "Water boils at", "A short poem about cats:", "The first president of the United States was"]
# Prompts holding a marker fail inside the engine step (option.fault_injection, engine/faults.py): at
# prefill (the error comes before any output) or at the step computing output token 3 (mid-stream).
FAULT_PREFILL, FAULT_DECODE = "Zebra-prefill-fault", "Zebra-decode-fault"
FAULT_RULES = f"prefill@{FAULT_PREFILL};decode:2@{FAULT_DECODE}"
GENERATION_ERROR, TIMEOUT, CANCELLED, BUSY = 424, 504, 409, 503   # the server's statuses (frontend/)

# Verdicts. Every other outcome is a defect: the run reports it and exits non-zero.
GOOD = {"ok", "refused", "faulted", "deadline", "cancelled", "disconnected", "finished_first", "batch_ok"}


@dataclass(frozen=True)
class Case:
    """One distinct greedy request: its solo answer is computed once, before the traffic."""

    kind: str          # "text": the raw prompt; "chat": one user message through the chat template
    prompt: str
    max_tokens: int


def make_cases(num_prompts: int) -> list[Case]:
    """Two cases (text, chat) per prompt, with 6-20 new tokens each."""
    return [Case(kind, prompt, 6 + (3 * i + 7 * (kind == "chat")) % 15)
            for i, prompt in enumerate(PROMPTS[:num_prompts]) for kind in ("text", "chat")]


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    kind: str          # which solo answer applies (Case.kind)
    stream: bool
    dialect: str       # lmi | lmi_chat | openai_chat | openai_completion | tgi


ROUTES = [Route("invocations", "/invocations", "text", False, "lmi"),
          Route("invocations_stream", "/invocations", "text", True, "lmi"),
          Route("invocations_chat", "/invocations", "chat", False, "lmi_chat"),
          Route("chat", "/v1/chat/completions", "chat", False, "openai_chat"),
          Route("chat_stream", "/v1/chat/completions", "chat", True, "openai_chat"),
          Route("completions", "/v1/completions", "text", False, "openai_completion"),
          Route("completions_stream", "/v1/completions", "text", True, "openai_completion"),
          Route("generate", "/generate", "text", False, "tgi"),
          Route("generate_stream", "/generate_stream", "text", True, "tgi")]
BY_NAME = {route.name: route for route in ROUTES}


def request_body(route: Route, model: str, prompt: str, max_tokens: int, n: int = 1,
                 ignore_eos: bool = False) -> dict:
    """A greedy request of `route` (OpenAI forms send temperature 0: their default samples at 1.0)."""
    if route.dialect in ("lmi", "tgi"):
        params = {"max_new_tokens": max_tokens, **({"ignore_eos": True} if ignore_eos else {})}
        return {"inputs": prompt, "parameters": params, **({"stream": route.stream} if route.dialect == "lmi" else {})}
    openai = {"max_tokens": max_tokens, "temperature": 0, **({"ignore_eos": True} if ignore_eos else {})}
    if route.dialect == "lmi_chat":
        return {"messages": [{"role": "user", "content": prompt}], **openai}
    key = {"messages": [{"role": "user", "content": prompt}]} if route.dialect == "openai_chat" else {"prompt": prompt}
    return {"model": model, **key, **openai, "stream": route.stream, **({"n": n} if n > 1 else {})}


@dataclass
class Answer:
    """What came back: the texts (one per choice), or the error (HTTP status or the stream's error line)."""

    status: int
    texts: list[str] = field(default_factory=list)
    error: str | None = None
    code: int | None = None
    malformed: str | None = None     # the answer breaks its own contract (bad JSON, streamed texts != generated_text)


def error_code(message: str, code: int | None) -> int | None:
    """The status of an error; TGI's stream error event has none, so it is read from the message."""
    if code is not None:
        return code
    for words, status in (("timed out", TIMEOUT), ("cancelled", CANCELLED), ("internal error", GENERATION_ERROR)):
        if words in message:
            return status
    return None


def parse_document(route: Route, status: int, content: bytes) -> Answer:
    try:
        doc = json.loads(content)
    except ValueError:
        return Answer(status, malformed=f"not JSON: {content[:120]!r}")
    if status != 200:
        error = doc.get("error") if isinstance(doc, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        return Answer(status, error=str(message), code=status)
    if route.dialect in ("lmi", "tgi"):
        return Answer(status, [doc["generated_text"]])
    choices = sorted(doc["choices"], key=lambda c: c["index"])
    if route.dialect == "openai_completion":
        return Answer(status, [c["text"] for c in choices])
    return Answer(status, [c["message"]["content"] or "" for c in choices])


def parse_stream(route: Route, lines: list[str]) -> Answer:
    """An answer from its stream's lines (jsonlines, or SSE `data:` events)."""
    texts: dict[int, str] = {}
    final: str | None = None
    for line in lines:
        data = line.removeprefix("data:").strip()
        if not data or data == "[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            code = error.get("code") if isinstance(error, dict) else event.get("code")
            return Answer(200, error=message, code=error_code(message, code))
        if route.dialect.startswith("openai"):
            for choice in event.get("choices") or []:
                piece = choice.get("text") if route.dialect == "openai_completion" else choice["delta"].get("content")
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
        else:
            texts[0] = texts.get(0, "") + event["token"]["text"]
            final = event.get("generated_text") or final
    answer = Answer(200, [texts[i] for i in sorted(texts)] or [""])
    if final is not None and final != answer.texts[0]:
        answer.malformed = f"streamed texts {answer.texts[0]!r} != generated_text {final!r}"
    return answer


async def send(client: httpx.AsyncClient, route: Route, body: dict, headers: dict | None = None,
               after_first: Callable[[], Awaitable[bool]] | None = None) -> Answer | None:
    """POST `body` and read the whole answer. A stream calls `after_first` once its first line arrived;
    when it returns False the client goes away there (closing the connection) and None is returned."""
    if not route.stream:
        response = await client.post(route.path, json=body, headers=headers)
        return parse_document(route, response.status_code, response.content)
    async with client.stream("POST", route.path, json=body, headers=headers) as response:
        if response.status_code != 200:
            return parse_document(route, response.status_code, await response.aread())
        lines: list[str] = []
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            lines.append(line)
            if after_first is not None and len(lines) == 1 and not await after_first():
                return None
    return parse_stream(route, lines)


def describe_error(exc: BaseException) -> str:
    """An exception and the chain under it (httpx.ReadError <- httpcore.ReadError <- ConnectionResetError ...)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 4:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}"[:120])
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts)


@dataclass
class Result:
    action: str
    route: str
    outcome: str
    latency_s: float
    detail: str = ""


def judge(action: str, answer: Answer, expected: str | None) -> tuple[str, str]:
    """(outcome, detail) of one answer; see GOOD for the outcomes that are not defects."""
    if answer.malformed:
        return "malformed", answer.malformed
    if answer.error is not None:
        code = answer.code
        if answer.status == BUSY and code == BUSY:
            return "refused", ""
        allowed = {"fault": GENERATION_ERROR, "deadline": TIMEOUT, "cancel": CANCELLED}.get(action)
        if code is not None and code == allowed:
            return {"fault": "faulted", "deadline": "deadline", "cancel": "cancelled"}[action], ""
        return "unexpected_error", f"{answer.status}/{code}: {answer.error[:200]}"
    if action == "fault":
        return "fault_missed", f"a faulted prompt answered {answer.texts!r}"
    wrong = [text for text in answer.texts if text != expected]
    if wrong:
        return "mismatch", f"expected {expected!r}, got {wrong[0]!r} ({len(wrong)}/{len(answer.texts)} choices)"
    return ("finished_first" if action in ("deadline", "cancel", "disconnect") else "ok"), ""


class Traffic:
    """Runs actions against one server: `model` is its served name, `solo` the solo answer of every Case."""

    def __init__(self, client: httpx.AsyncClient, model: str, cases: list[Case], solo: dict[Case, str],
                 rng: random.Random, timeout_s: float = 300.0):
        self.client, self.model, self.cases, self.solo, self.rng = client, model, cases, solo, rng
        self.timeout_s = timeout_s
        self.counter = 0

    async def run(self, action: str, route: Route | None = None) -> Result:
        """One request of `action` (plain | n | disconnect | cancel | deadline | fault) on `route` (random if None)."""
        route = route or self.rng.choice(ROUTES)
        if action == "n":
            route = self.rng.choice([BY_NAME["chat"], BY_NAME["chat_stream"], BY_NAME["completions"]])
        case = self.rng.choice([c for c in self.cases if c.kind == route.kind])
        self.counter += 1
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome, detail = await getattr(self, f"_{action}")(route, case)
        except TimeoutError:
            outcome, detail = "hung", f"no answer within {self.timeout_s:g} s"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            outcome, detail = "transport_error", describe_error(exc)
        return Result(action, route.name, outcome, time.monotonic() - start, detail)

    def _body(self, route: Route, case: Case, **kwargs) -> dict:
        return request_body(route, self.model, case.prompt, case.max_tokens, **kwargs)

    async def _plain(self, route: Route, case: Case) -> tuple[str, str]:
        return judge("plain", await send(self.client, route, self._body(route, case)), self.solo[case])

    async def _n(self, route: Route, case: Case) -> tuple[str, str]:
        n = self.rng.choice([2, 3])
        answer = await send(self.client, route, self._body(route, case, n=n))
        if answer.error is None and not answer.malformed and len(answer.texts) != n:
            return "malformed", f"{len(answer.texts)} choices for n={n}"
        return judge("n", answer, self.solo[case])

    async def _fault(self, route: Route, case: Case) -> tuple[str, str]:
        marker = self.rng.choice([FAULT_PREFILL, FAULT_DECODE])
        body = request_body(route, self.model, f"{case.prompt} {marker}", 12, ignore_eos=True)
        return judge("fault", await send(self.client, route, body), None)

    async def _deadline(self, route: Route, case: Case) -> tuple[str, str]:
        headers = {"X-Request-Timeout": f"{self.rng.uniform(0.05, 1.5):.3f}"}
        return judge("deadline", await send(self.client, route, self._body(route, case), headers), self.solo[case])

    async def _disconnect(self, route: Route, case: Case) -> tuple[str, str]:
        body = self._body(route, case)
        if route.stream:       # gone after the first line of the stream
            async def leave() -> bool:
                return False
            answer = await send(self.client, route, body, after_first=leave)
        else:                  # gone before the answer: the client's read timeout closes the connection
            try:
                response = await self.client.post(route.path, json=body, timeout=self.rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                return "disconnected", ""
            answer = parse_document(route, response.status_code, response.content)
        return ("disconnected", "") if answer is None else judge("disconnect", answer, self.solo[case])

    async def _cancel(self, route: Route, case: Case) -> tuple[str, str]:
        request_id = f"soak-cancel-{self.counter}-{self.rng.randrange(1 << 30)}"
        headers = {"x-request-id": request_id}

        async def cancel() -> bool:
            await self.client.post(f"/v1/requests/{request_id}/cancel")
            return True

        if route.stream:
            answer = await send(self.client, route, self._body(route, case), headers, after_first=cancel)
        else:
            task = asyncio.create_task(send(self.client, route, self._body(route, case), headers))
            await asyncio.sleep(self.rng.uniform(0.1, 0.6))
            await cancel()
            answer = await task
        return judge("cancel", answer, self.solo[case])


BATCH_DONE = ("completed", "failed", "expired", "cancelled")


async def batch_job(client: httpx.AsyncClient, model: str, cases: list[Case], solo: dict[Case, str],
                    timeout_s: float = 600.0) -> Result:
    """One job through /v1/files + /v1/batches: the chat cases as greedy lines plus one faulted line; every
    answered line must be its solo answer and the faulted one must fail. Its files are deleted after."""
    start = time.monotonic()
    chat = [case for case in cases if case.kind == "chat"]
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": case.prompt}],
                       "max_completion_tokens": case.max_tokens}} for i, case in enumerate(chat)]
    lines.append({"custom_id": "faulted", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": model, "messages": [{"role": "user", "content": f"Hi {FAULT_PREFILL}"}],
                           "max_completion_tokens": 4}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    files: list[str] = []
    try:
        upload = await client.post("/v1/files", files={"file": ("soak.jsonl", data)}, data={"purpose": "batch"})
        files.append(upload.json()["id"])
        created = await client.post("/v1/batches", json={"input_file_id": files[0], "completion_window": "24h",
                                                         "endpoint": "/v1/chat/completions"})
        batch = created.json()
        async with asyncio.timeout(timeout_s):
            while batch["status"] not in BATCH_DONE:
                await asyncio.sleep(0.5)
                batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
        records = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                files.append(batch[key])
                content = (await client.get(f"/v1/files/{batch[key]}/content")).text
                records += [json.loads(line) for line in content.splitlines() if line.strip()]
        outcome, detail = _judge_batch(batch, records, dict(zip((f"line-{i}" for i in range(len(chat))), chat)), solo)
    except TimeoutError:
        outcome, detail = "hung", f"batch not done within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        outcome, detail = "batch_error", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        for file_id in files:
            try:
                await client.delete(f"/v1/files/{file_id}")
            except httpx.HTTPError:
                pass
    return Result("batch", "/v1/batches", outcome, time.monotonic() - start, detail)


def _judge_batch(batch: dict, records: list[dict], by_id: dict[str, Case], solo: dict[Case, str]) -> tuple[str, str]:
    if batch["status"] != "completed":
        return "batch_failed", f"status {batch['status']}: {batch.get('errors')}"
    seen = {record["custom_id"]: record for record in records}
    if set(seen) != {*by_id, "faulted"} or len(records) != len(by_id) + 1:
        return "batch_mismatch", f"custom_ids {sorted(seen)} for {len(by_id) + 1} lines"
    if seen["faulted"]["response"]["status_code"] == 200:
        return "batch_mismatch", "the faulted line answered 200"
    for custom_id, case in by_id.items():
        response = seen[custom_id]["response"]
        text = response["body"]["choices"][0]["message"]["content"] if response["status_code"] == 200 else None
        if text != solo[case]:
            return "batch_mismatch", f"{custom_id}: expected {solo[case]!r}, got {response['status_code']} {text!r}"
    return "batch_ok", ""


async def solo_answers(client: httpx.AsyncClient, model: str, cases: list[Case]) -> dict[Case, str]:
    """Each case alone on the server, one after another: text on /invocations, chat on /v1/chat/completions."""
    solo = {}
    for case in cases:
        route = BY_NAME["invocations" if case.kind == "text" else "chat"]
        answer = await send(client, route, request_body(route, model, case.prompt, case.max_tokens))
        if answer.error is not None or answer.malformed:
            raise RuntimeError(f"solo request for {case} failed: {answer}")
        solo[case] = answer.texts[0]
    return solo
