"""handle(inputs): the DJL Serving Python entry point — init on the first call, then rolling or dynamic batch.

Owns the DJL step protocol of DESIGN §2 (batch_NNN keys, one binary-encoded entry per item,
order kept); the request plan is service.py's, objects are protocol/'s, generation the engine's.
A Handler holds what handle() keeps between calls: the container's is this module's `handle`; the
bundled server makes its own (server/app.py), so two apps in one process never share a model.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from lmi_handler.config import Settings
from lmi_handler.djl import Input, Output
from lmi_handler.engine.faults import FaultInjector, FaultRule, StepGuard
from lmi_handler.engine.health import EngineDead, EngineHealth
from lmi_handler.engine.parallel.launch import run_mpi_follower
from lmi_handler.engine.sequence import RequestOutput
from lmi_handler.pooling_answers import PoolingAnswers
from lmi_handler.pooling_handler import PoolingHandler
from lmi_handler.pooling_service import PoolingService, served_task
from lmi_handler.protocol.custom_output import CustomAnswer, FormatterError
from lmi_handler.protocol.dialects import dialect_of
from lmi_handler.protocol.encoder import Wire, encode, encode_bytes
from lmi_handler.protocol.errors import GENERATION_ERROR_CODE, error_body
from lmi_handler.protocol.formatters import Answer, StreamAnswer, outputs_line, response_body
from lmi_handler.protocol.plan import RequestPlan
from lmi_handler.protocol.sequences import Member
from lmi_handler.service import ADAPTER_HEADER, Service

logger = logging.getLogger(__name__)

ROUTE_PROPERTY = "X-Lmi-Route"  # the HTTP path, passed per item like the front end passes headers
# Ours, not DJL's: the bundled front end marks a running item whose client went away, so its
# sequences stop at once instead of generating to the end for nobody.
CANCEL_PROPERTY = "X-Lmi-Cancel"
# Ours, in-process only: the bundled front end hands over a Handover (the RequestPlan it built from the
# same bytes, to answer 4xx early) as a content entry beside `data`; DJL's front end never sends it, so
# the handler then plans from `data` itself. Either way a request is parsed and tokenized once.
HANDOVER_KEY = "X-Lmi-Handover"


@dataclass(frozen=True)
class Handover:
    """What the bundled front end hands over with an item, in-process: its plan, and where the whole
    answer's object goes once it exists (`answered(body)`, before the last entry is returned), so an
    in-process caller (the batch jobs) never parses the JSON text the entry carries."""

    plan: RequestPlan
    answered: Callable[[Any], None]


def _handover(item: Input) -> Handover | None:
    handed = item.content.get(HANDOVER_KEY)
    return handed if isinstance(handed, Handover) else None


def plan_item(service: Service, item: Input, request_id: str) -> RequestPlan:
    """The item's plan: the one the front end handed over, else parsed from its body by its route
    (/invocations, an OpenAI route, /generate) and content type. Raises RequestValidationError."""
    handed = _handover(item)
    if handed is not None:
        return handed.plan
    return service.plan(item.get_as_bytes("data"), route=item.get_property(ROUTE_PROPERTY),
                        content_type=item.get_property("Content-Type"), request_id=request_id,
                        adapter_header=item.get_property(ADAPTER_HEADER))


@dataclass
class ActiveRequest:
    """One item of the front end's active batch, in the front end's order."""

    request_id: str
    plan: RequestPlan | None = None
    members: list[Member] = field(default_factory=list)    # n / best_of: the engine sequences, prompt by prompt
    error: str | None = None          # set when the request failed; answered once with last=true
    error_code: int = GENERATION_ERROR_CODE   # 400 when the engine found the request itself invalid
    error_param: str | None = None    # the field a 400 names (OpenAI's `param`)
    done: bool = False
    cancelled: bool = False           # the client went away: answered once with last=true, no data
    handover: Handover | None = None  # in-process: where the whole answer's object goes too
    stream: StreamAnswer | None = field(default=None, init=False)  # a streamed answer's formatter
    answer: Answer | None = field(default=None, init=False)          # a whole answer's collector
    custom: CustomAnswer | None = field(default=None, init=False)    # model.py's formatter, RequestOutput form

    def __post_init__(self) -> None:
        rule = self.plan.custom_output if self.plan is not None else None
        if rule is not None and not rule.takes_dict:
            prompt = self.plan.prompts[0]
            self.custom = CustomAnswer(rule, self.request_id, prompt.text, prompt.token_ids, self.plan.stream)
        elif self.plan is not None and self.plan.stream:
            self.stream = StreamAnswer(self.plan, self.members)
        elif self.plan is not None:
            count = self.plan.sequences.count      # completions with a list of prompts: count members each
            self.answer = Answer(self.plan, [self.members[p * count:(p + 1) * count]
                                             for p in range(len(self.plan.prompts))])

    @property
    def content_type(self) -> str:
        return self.plan.content_type if self.plan is not None else "application/json"

    def data(self, outputs: dict) -> tuple[str, bool]:
        """This step's text and whether it is the last: streamed as it comes, else the whole answer at the end.
        Raises FormatterError when model.py's output formatter fails."""
        if self.custom is not None:
            return self.custom.step(outputs.get(self.members[0].request_id))
        reshape = self.plan.custom_output.reshape if self.plan.custom_output is not None else _unchanged
        if self.stream is not None:
            events = [reshape(event) for event in self.stream.events(outputs)]
            return encode(events, self.plan.wire), self.stream.finished
        for member in self.members:
            if member.request_id in outputs:
                self.answer.add(outputs[member.request_id])
        if not self.answer.done:
            return "", False
        body = reshape(self.answer.body())
        if self.handover is not None:
            self.handover.answered(body)
        return encode([body], Wire.JSON), True


def _unchanged(obj: Any) -> Any:
    return obj


def refused_field(plan: RequestPlan) -> str:
    """The field a refusal names: where the request's structured-output constraint came."""
    return plan.constraint_field or "structured_outputs"


def refused_message(plan: RequestPlan, out: RequestOutput) -> str:
    """The 400's message for a request the engine refused before any token (its grammar did not compile,
    or not within option.structured_output_compile_timeout_s), naming the field the constraint came in."""
    return f"Invalid parameter `{refused_field(plan)}`: {out.error}"


def _refused(members: list[list[Member]], results: dict) -> list[RequestOutput]:
    """The last outputs of a dynamic-batch request's sequences that the engine refused (invalid_request)."""
    last = [results[m.request_id][-1] for prompt_members in members for m in prompt_members
            if results.get(m.request_id)]
    return [out for out in last if out.invalid_request]


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def _item_seed(item: Input) -> int | None:
    """The front end's per-request seed (content `seed`; may be negative)."""
    raw = item.get_as_bytes("seed") if item.content.get("seed") is not None else b""
    try:
        return int(raw.decode().strip()) if raw else None
    except ValueError:
        return None


StepObserver = Callable[[list[ActiveRequest], dict], None]


@dataclass(frozen=True)
class _Failed:
    """A dynamic-batch item answered with an error before inference."""

    message: str
    code: int = GENERATION_ERROR_CODE


class RollingBatch:
    """The rolling-batch side of handle(): one call = one engine step for the whole active batch."""

    def __init__(self, service: Service, guard: StepGuard, observers: list[StepObserver] | None = None):
        self.service = service
        self.active: list[ActiveRequest] = []
        self.guard = guard
        # Called after each step with (active requests, their done/cancelled/error marks set; outputs by
        # sequence id): the bundled server's metrics (server/metrics.py RequestTracker.on_step).
        self.observers = list(observers or ())

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
        try:
            outputs = self._run_engine()
        except EngineDead:      # the guard dropped every sequence; the caller fails every request of this call
            self.active = []
            raise
        answer = Output()
        for index, request in enumerate(self.active):
            self._answer(answer, index, request, outputs)
        for observe in self.observers:
            observe(self.active, outputs)
        self.active = [r for r in self.active if not r.done]
        return answer

    def _cancel(self, request: ActiveRequest) -> None:
        """Stop a running request now: its sequences leave the engine and free their KV blocks."""
        self._abort_members(request)
        request.cancelled = True

    def _admit(self, item: Input) -> ActiveRequest:
        request_id = item.get_property("requestId") or uuid.uuid4().hex
        try:
            plan = plan_item(self.service, item, request_id)
            request_members = self.service.add_prompts(plan, plan.members(_item_seed(item)))
        except Exception as exc:  # noqa: BLE001 - any failure stays with this request (DESIGN §2)
            logger.info("request %s rejected: %s", request_id, exc)
            code = exc.status_code if isinstance(exc, FormatterError) else GENERATION_ERROR_CODE
            return ActiveRequest(request_id, error=str(exc), error_code=code)
        return ActiveRequest(request_id, plan, request_members, handover=_handover(item))

    def _run_engine(self) -> dict:
        """One engine step; a fault ends only the requests whose sequences it hit (engine/faults.py).
        Raises EngineDead when the engine can no longer generate at all (engine/health.py)."""
        engine = self.service.engine
        if not engine.has_unfinished:
            return {}
        try:
            outputs, failed = self.guard.step()
        except EngineDead:
            raise
        except Exception:  # isolation itself broke: fail this batch, keep serving
            logger.exception("engine step failed and could not be isolated; failing the active batch")
            self._fail_active("internal error during generation")
            engine.abort_all()
            return {}
        outputs_of = {out.request_id: out for out in outputs}
        for request in self.active:
            if request.error is not None or request.done:
                continue
            refused = next((outputs_of[m.request_id] for m in request.members
                            if m.request_id in outputs_of and outputs_of[m.request_id].invalid_request), None)
            hit = next((failed[m.request_id] for m in request.members if m.request_id in failed), None)
            if refused is not None:
                logger.info("request %s refused (400): %s", request.request_id, refused.error)
                self._end(request, refused_message(request.plan, refused), 400, refused_field(request.plan))
            elif hit is not None:
                logger.error("request %s failed: %s", request.request_id, hit)
                self._end(request, hit)
        return outputs_of

    def _end(self, request: ActiveRequest, error: str, code: int = GENERATION_ERROR_CODE,
             param: str | None = None) -> None:
        """Fail the request as a whole (n / best_of: every sibling sequence stops too); answered next."""
        request.error, request.error_code, request.error_param = error, code, param
        self._abort_members(request)

    def _abort_members(self, request: ActiveRequest) -> None:
        """Its sequences leave the engine now and free their KV blocks."""
        for member in request.members:
            self.service.engine.abort(member.request_id)

    def _fail_active(self, message: str) -> None:
        for request in self.active:
            if request.error is None and not request.done:
                request.error = message

    def _answer(self, answer: Output, index: int, request: ActiveRequest, outputs: dict) -> None:
        entry: dict[str, str] = {"data": "", "last": "false", "content_type": request.content_type,
                                 "request_id": request.request_id}
        if request.cancelled:
            entry["last"] = "true"
            request.done = True
        elif request.error is not None:
            entry.update(last="true", code=str(request.error_code), error=request.error,
                         content_type="application/json")
            if request.error_param:
                entry["param"] = request.error_param
            request.done = True
        else:
            try:
                data, last = request.data(outputs)
            except FormatterError as exc:      # model.py's output formatter: this request alone fails
                logger.warning("request %s: %s", request.request_id, exc)
                self._end(request, str(exc), exc.status_code)
                data, last = "", True
                entry.update(code=str(exc.status_code), error=str(exc), content_type="application/json")
            entry["data"] = data
            if last:
                entry["last"] = "true"
                request.done = True
                self._abort_members(request)   # n > 1: a choice's error ends the answer; siblings stop too
        answer.add(Output.binary_encode(entry), key="data", batch_index=index)
        answer.add_property(f"batch_{index}_Content-Type", entry["content_type"])
        answer.add_property(f"batch_{index}_requestId", request.request_id)


class DynamicBatch:
    """The dynamic-batch side of handle(): a call holds `batch_size` new requests, answered in full."""

    def __init__(self, service: Service, guard: StepGuard):
        self.service = service
        self.guard = guard       # dynamic batches run engine.generate whole: the guard only judges a failure

    def run(self, inputs: Input) -> Output:
        items = inputs.get_batches()
        plans: list[RequestPlan | _Failed] = [self._plan(item) for item in items]
        if len(plans) == 1 and isinstance(plans[0], RequestPlan) and plans[0].stream:
            return self._stream(plans[0])
        members_of = {p.request_id: p.members() for p in plans if isinstance(p, RequestPlan)}
        requests = [(m.request_id, list(q.token_ids), m.params)
                    for p in plans if isinstance(p, RequestPlan)
                    for q, prompt_members in zip(p.prompts, members_of[p.request_id]) for m in prompt_members]
        try:
            results = self.service.engine.generate(requests)
        except Exception as exc:
            logger.exception("dynamic batch failed")
            self.service.engine.abort_all()
            self.guard.check_failure(exc)     # raises EngineDead if the engine itself is dead
            results, plans = {}, [_Failed("internal error during generation") if isinstance(p, RequestPlan) else p
                                  for p in plans]
        answer = Output()
        for index, (item, plan) in enumerate(zip(items, plans)):
            refused = _refused(members_of[plan.request_id], results) if isinstance(plan, RequestPlan) else []
            if isinstance(plan, _Failed):
                body = error_body(dialect_of(item.get_property(ROUTE_PROPERTY)), plan.message, plan.code)
                answer.add_property(f"batch_{index}_code", str(plan.code))
            elif refused:
                body = error_body(plan.dialect, refused_message(plan, refused[0]), 400, refused_field(plan))
                answer.add_property(f"batch_{index}_code", "400")
            else:
                body = response_body(plan, members_of[plan.request_id], results)
                handed = _handover(item)
                if handed is not None:
                    handed.answered(body)
            answer.add(encode_bytes(body), key="data", batch_index=index)
            answer.add_property(f"batch_{index}_Content-Type", "application/json")
        answer.add_property("content-type", "application/json")
        return answer

    def _stream(self, plan: RequestPlan) -> Output:
        """LMI dynamic-batch streaming: one {"outputs": [new text per input]} line per step."""
        answer = Output()
        answer.add_property("Content-Type", plan.content_type)
        answer.add_stream_content(self._stream_lines(plan), output_formatter=None)
        return answer

    def _stream_lines(self, plan: RequestPlan) -> Iterator[str]:
        order = [p.request_id for p in plan.prompts]
        steps = self.service.engine.iterate([(p.request_id, list(p.token_ids), p.params) for p in plan.prompts])
        try:
            for outputs in steps:
                texts = {out.request_id: "".join(t.text for t in out.new_tokens) for out in outputs}
                if any(texts.values()):
                    yield encode([outputs_line([texts.get(rid, "") for rid in order])], plan.wire)
        except Exception as exc:
            if not isinstance(exc, EngineDead):
                steps.close()                     # its sequences leave the engine before the probe runs
                self.guard.check_failure(exc)     # raises EngineDead if the engine itself is dead
            raise
        finally:
            steps.close()  # a consumer that stops early aborts the sequences still running

    def _plan(self, item: Input) -> RequestPlan | _Failed:
        try:
            return plan_item(self.service, item, item.get_property("requestId") or uuid.uuid4().hex)
        except FormatterError as exc:     # model.py's input formatter failed: the server's code, a 500
            return _Failed(str(exc), exc.status_code)
        except Exception as exc:  # noqa: BLE001 - a plan that fails answers its item with 424 (DESIGN §2)
            return _Failed(str(exc))


class Handler:
    """What handle() keeps between calls: the Service (made on the first call), the engine's health, and the
    rolling or the dynamic side. `settings`: already parsed by the caller (the bundled server parses them
    once); None: parsed from the first call's properties, as in the container. `observers` get every rolling
    step."""

    def __init__(self, settings: Settings | None = None, observers: list[StepObserver] | None = None):
        self.settings = settings
        self.observers = list(observers or ())
        self.service: Service | None = None
        self.health = EngineHealth()      # one for both sides: dead is dead, whichever batch found it
        self.rolling: RollingBatch | None = None
        self.dynamic: DynamicBatch | None = None
        self.pooling: PoolingHandler | None = None     # a pooling model's handle() (option.task)

    def handle(self, inputs: Input) -> Output | None:
        """DJL entry point (DESIGN §2): the first call carries the properties; an empty call returns None.

        Raises EngineDead from the call in which the engine is found dead (engine/health.py) and on every
        call after it, so DJL's worker recovery (or the bundled front end) fails the requests and restarts.
        On an MPI rank above 0 the first call serves rank 0's steps until rank 0 shuts down, then returns None.
        """
        if self.service is None and self.pooling is None and not self._initialize(inputs.get_properties()):
            return None
        if inputs.is_empty():
            return None
        if self.pooling is not None:            # a pooling model: pooling_handler.py answers every item now
            return self.pooling.handle(inputs)
        self.health.check()
        if self.settings.is_rolling:
            return self.rolling.step(inputs)
        return self.dynamic.run(inputs)

    def failure(self) -> Exception | None:
        """The error that ended the engine for good (Engine.failure), for health checks; None while it can
        serve, or before it is loaded (the front end's own readiness covers that)."""
        return None if self.service is None else self.service.engine.failure()

    def _initialize(self, properties) -> bool:
        """Build the Service; False on an MPI follower rank, whose init call was the follower loop."""
        if self.settings is None:
            self.settings = Settings.from_properties(dict(properties))
        if served_task(self.settings) != "text-generation":
            answers = PoolingAnswers(PoolingService(self.settings), self.settings.served_model_names)
            self.pooling = PoolingHandler(answers, self.settings.is_rolling)
            return True
        engine_config = self.settings.engine_config()
        if engine_config.parallel.mpi is not None and engine_config.parallel.mpi.rank > 0:
            # LMI's MPI launch: ranks above 0 get only the init call; they serve rank 0's steps from inside it
            run_mpi_follower(engine_config)
            return False
        self.service = Service(self.settings)
        if self.settings.fault_injection:  # option.fault_injection (engine/faults.py): tests only
            FaultInjector(self.service.engine, FaultRule.parse_all(self.settings.fault_injection))
        guard = StepGuard(self.service.engine, self.health)
        self.rolling = RollingBatch(self.service, guard, self.observers)
        self.dynamic = DynamicBatch(self.service, guard)
        return True


_CONTAINER = Handler()   # the DJL container's worker: one model per process


def handle(inputs: Input) -> Output | None:
    """DJL entry point (DESIGN §2; `option.entryPoint=lmi_handler.handler`): the container's Handler."""
    return _CONTAINER.handle(inputs)
