"""handle(inputs): the DJL Serving Python entry point — init on the first call, then rolling or dynamic batch.

Owns the DJL step protocol of DESIGN §2 (batch_NNN keys, one binary-encoded entry per item,
order kept); parsing is protocol/'s, generation the engine's, HTTP server/'s.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Iterator

from lmi_handler.config import Settings
from lmi_handler.djl import Input, Output
from lmi_handler.engine.sequence import RequestOutput, SamplingParams
from lmi_handler.protocol.formatters import Formatter, dynamic_batch_stream_line, make_formatter, render_best_of
from lmi_handler.service import PreparedRequest, Service

logger = logging.getLogger(__name__)

ERROR_CODE = 424  # DESIGN §2: a failed item answers 424
ROUTE_PROPERTY = "X-Lmi-Route"  # the HTTP path, passed per item like the front end passes headers
# Ours, not DJL's: the bundled front end marks a running item whose client went away, so its
# sequences stop at once instead of generating to the end for nobody.
CANCEL_PROPERTY = "X-Lmi-Cancel"


def _parse_item(service: Service, item: Input):
    """Parse one item's body by its route (/invocations or an OpenAI route) and content type."""
    return service.parse(item.get_as_bytes("data"), route=item.get_property(ROUTE_PROPERTY),
                         content_type=item.get_property("Content-Type"))


@dataclass
class ActiveRequest:
    """One item of the front end's active batch, in the front end's order."""

    request_id: str
    content_type: str = "application/json"
    formatter: Formatter | None = None
    error: str | None = None          # set when the request failed; answered once with last=true
    done: bool = False
    cancelled: bool = False           # the client went away: answered once with last=true, no data
    prepared: PreparedRequest | None = None
    members: list[tuple[str, SamplingParams]] = field(default_factory=list)   # n / best_of sequences
    collected: dict[str, list[RequestOutput]] = field(default_factory=dict)

    def collect(self, outputs: dict[str, RequestOutput]) -> str | None:
        """n / best_of: gather each member's outputs; the rendered answer once all have finished."""
        for member_id, _ in self.members:
            if member_id in outputs:
                self.collected.setdefault(member_id, []).append(outputs[member_id])
        runs = [self.collected.get(member_id, []) for member_id, _ in self.members]
        if not all(run and run[-1].finished for run in runs):
            return None
        return render_best_of(self.prepared.context, runs, [params.seed for _, params in self.members])


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def _item_seed(item: Input) -> int | None:
    """The front end's per-request seed (content `seed`; may be negative)."""
    raw = item.get_as_bytes("seed") if item.content.get("seed") is not None else b""
    try:
        return int(raw.decode().strip()) if raw else None
    except ValueError:
        return None


def add_members(engine, prepared: PreparedRequest, members: list, seed: int | None) -> None:
    """Queue every sequence of a request; if one is refused, the ones already queued are dropped."""
    added: list[str] = []
    try:
        for member_id, params in members:
            engine.add_request(member_id, prepared.prompt_token_ids, params, seed=seed)
            added.append(member_id)
    except Exception:
        for member_id in added:
            engine.abort(member_id)
        raise


class RollingBatch:
    """The rolling-batch side of handle(): one call = one engine step for the whole active batch."""

    def __init__(self, service: Service):
        self.service = service
        self.active: list[ActiveRequest] = []

    def reset(self) -> None:
        """reset_rollingbatch: drop all state first; every item of this call is new."""
        self.service.engine.abort_all()
        self.active = []

    def step(self, inputs: Input) -> Output:
        if _truthy(inputs.get_property("reset_rollingbatch")):
            self.reset()
        items = inputs.get_batches()
        if len(items) < len(self.active):
            logger.error("front end sent %d items for %d active requests; resetting", len(items), len(self.active))
            self.reset()
        for request, item in zip(self.active, items):
            if _truthy(item.get_property(CANCEL_PROPERTY)):
                self._cancel(request)
        for item in items[len(self.active):]:
            self.active.append(self._admit(item))
        outputs = self._run_engine()
        answer = Output()
        for index, request in enumerate(self.active):
            self._answer(answer, index, request, outputs)
        self.active = [r for r in self.active if not r.done]
        return answer

    def _cancel(self, request: ActiveRequest) -> None:
        """Stop a running request now: its sequences leave the engine and free their KV blocks."""
        for member_id, _ in request.members:
            self.service.engine.abort(member_id)
        request.cancelled = True

    def _admit(self, item: Input) -> ActiveRequest:
        request_id = item.get_property("requestId") or uuid.uuid4().hex
        try:
            request = _parse_item(self.service, item)
            prepared: PreparedRequest = self.service.prepare(request, request_id)[0]
            seed = _item_seed(item)
            members = prepared.members(seed)
            add_members(self.service.engine, prepared, members, seed)
        except Exception as exc:  # any failure stays with this request (DESIGN §2)
            logger.info("request %s rejected: %s", request_id, exc)
            return ActiveRequest(request_id, error=str(exc))
        formatter = make_formatter(prepared.context)
        return ActiveRequest(request_id, formatter.content_type, formatter, prepared=prepared, members=members)

    def _run_engine(self) -> dict:
        engine = self.service.engine
        if not engine.has_unfinished:
            return {}
        try:
            return {out.request_id: out for out in engine.step()}
        except Exception:  # a bug in a step must not kill the worker: fail this batch, keep serving
            logger.exception("engine step failed; failing the active batch")
            for request in self.active:
                if request.error is None and not request.done:
                    request.error = "internal error during generation"
            engine.abort_all()
            return {}

    def _answer(self, answer: Output, index: int, request: ActiveRequest, outputs: dict) -> None:
        entry: dict[str, str] = {"data": "", "last": "false", "content_type": request.content_type,
                                 "request_id": request.request_id}
        if request.cancelled:
            entry["last"] = "true"
            request.done = True
        elif request.error is not None:
            entry.update(last="true", code=str(ERROR_CODE), error=request.error,
                         content_type="application/json")
            request.done = True
        elif len(request.members) > 1:
            rendered = request.collect(outputs)
            if rendered is not None:
                entry.update(data=rendered, last="true")
                request.done = True
        elif request.request_id in outputs:
            out = outputs[request.request_id]
            entry["data"] = request.formatter.format(out)
            if out.finished:
                entry["last"] = "true"
                request.done = True
        answer.add(Output.binary_encode(entry), key="data", batch_index=index)
        answer.add_property(f"batch_{index}_Content-Type", entry["content_type"])
        answer.add_property(f"batch_{index}_requestId", request.request_id)


class DynamicBatch:
    """The dynamic-batch side of handle(): a call holds `batch_size` new requests, answered in full."""

    def __init__(self, service: Service):
        self.service = service

    def run(self, inputs: Input) -> Output:
        items = inputs.get_batches()
        plans: list[list[PreparedRequest] | str] = [self._prepare(item) for item in items]
        if len(plans) == 1 and isinstance(plans[0], list) and plans[0][0].context.stream:
            return self._stream(plans[0])
        members = {p.request_id: p.members() for plan in plans if isinstance(plan, list) for p in plan}
        requests = [(member_id, p.prompt_token_ids, params)
                    for plan in plans if isinstance(plan, list) for p in plan
                    for member_id, params in members[p.request_id]]
        try:
            results = self.service.engine.generate(requests)
        except Exception:
            logger.exception("dynamic batch failed")
            self.service.engine.abort_all()
            results, plans = {}, ["internal error during generation" if isinstance(p, list) else p for p in plans]
        answer = Output()
        for index, plan in enumerate(plans):
            if isinstance(plan, str):
                answer.add_as_json({"error": plan, "code": ERROR_CODE}, batch_index=index)
                answer.add_property(f"batch_{index}_code", str(ERROR_CODE))
            else:
                docs = [self._result(p, members[p.request_id], results) for p in plan]
                openai_shape = plan[0].context.chat or plan[0].context.completion
                answer.add_as_json(docs[0] if openai_shape else docs, batch_index=index)
            answer.add_property(f"batch_{index}_Content-Type", "application/json")
        return answer

    def _stream(self, plan: list[PreparedRequest]) -> Output:
        """LMI dynamic-batch streaming: one {"outputs": [new text per input]} line per step."""
        answer = Output()
        answer.add_property("Content-Type", "application/jsonlines")
        answer.add_stream_content(self._stream_lines(plan), output_formatter=None)
        return answer

    def _stream_lines(self, plan: list[PreparedRequest]) -> Iterator[str]:
        order = [p.request_id for p in plan]
        steps = self.service.engine.iterate([(p.request_id, p.prompt_token_ids, p.params) for p in plan])
        try:
            for outputs in steps:
                texts = {out.request_id: "".join(t.text for t in out.new_tokens) for out in outputs}
                if any(texts.values()):
                    yield dynamic_batch_stream_line([texts.get(rid, "") for rid in order])
        finally:
            steps.close()  # a consumer that stops early aborts the sequences still running

    def _prepare(self, item: Input) -> list[PreparedRequest] | str:
        try:
            request = _parse_item(self.service, item)
            return self.service.prepare(request, item.get_property("requestId") or uuid.uuid4().hex)
        except Exception as exc:
            return str(exc)

    @staticmethod
    def _result(prepared: PreparedRequest, members: list, results: dict) -> dict:
        """One prompt's answer: `{"generated_text", "details"?}` (LMI dynamic batch list element), or the
        whole OpenAI object for chat (`messages`) and OpenAI-route requests."""
        context = prepared.context
        context.stream = False
        runs = [results[member_id] for member_id, _ in members]
        if context.chat or context.completion:
            formatter = make_formatter(context)
            return json.loads("".join(formatter.format(out) for out in runs[0]))
        context.tgi_compat, context.output_formatter = False, "json"
        if len(runs) > 1:
            return json.loads(render_best_of(context, runs, [params.seed for _, params in members]))
        formatter = make_formatter(context)
        return json.loads("".join(formatter.format(out) for out in runs[0]))


@dataclass
class HandlerState:
    """What handle() keeps between calls (a holder object, so nothing rebinds a module global)."""

    service: Service | None = None
    rolling: RollingBatch | None = None
    dynamic: DynamicBatch | None = None
    settings: Settings | None = field(default=None)

    def initialize(self, properties) -> None:
        self.settings = Settings.from_properties(dict(properties))
        self.service = Service(self.settings)
        self.rolling = RollingBatch(self.service)
        self.dynamic = DynamicBatch(self.service)


_STATE = HandlerState()


def handle(inputs: Input) -> Output | None:
    """DJL entry point (DESIGN §2): the first call carries the properties; an empty call returns None."""
    if _STATE.service is None:
        _STATE.initialize(inputs.get_properties())
    if inputs.is_empty():
        return None
    if _STATE.settings.is_rolling:
        return _STATE.rolling.step(inputs)
    return _STATE.dynamic.run(inputs)


def get_state() -> HandlerState:
    """The handler's state, for the bundled front end (pre-validation with the same tokenizer)."""
    return _STATE
