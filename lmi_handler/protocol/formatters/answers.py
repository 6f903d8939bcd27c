"""A request's answer from its engine outputs: the formatter each shape gets (whole or streamed), every
member of a prompt gathered (n, best_of, a list of prompts), and a failed stream's last objects per dialect.

Owns choosing and combining formatters by the plan (plan.py decides the shape); each dialect's shapes are
lmi.py's, tgi.py's and openai.py's, bytes the encoder's.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from lmi_handler.engine.sequence import RequestOutput
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.formatters.base import Formatter, is_error
from lmi_handler.protocol.formatters.lmi import LmiDocument, TokenStream
from lmi_handler.protocol.formatters.lmi import stream_failure as lmi_stream_failure
from lmi_handler.protocol.formatters.openai import (
    OPENAI_SHAPES,
    ChatDocument,
    ChatStream,
    CompletionDocument,
    CompletionStream,
    OpenAIStream,
    merge_openai_bodies,
    openai_body,
    stream_tail,
)
from lmi_handler.protocol.formatters.openai import stream_failure as openai_stream_failure
from lmi_handler.protocol.formatters.responses import ResponsesDocument, ResponsesStream
from lmi_handler.protocol.formatters.tgi import TgiDocument, TgiStream
from lmi_handler.protocol.formatters.tgi import stream_failure as tgi_stream_failure
from lmi_handler.protocol.plan import Kind, Prompt, RequestPlan, Shape
from lmi_handler.protocol.sequences import Combine, Member, combine_best_of

# One formatter per (shape, streamed): adding a shape adds a row here and its class above.
_DOCUMENTS = {Shape.LMI: LmiDocument, Shape.TGI: TgiDocument, Shape.CHAT: ChatDocument,
              Shape.COMPLETION: CompletionDocument, Shape.RESPONSES: ResponsesDocument}
_STREAMS = {Shape.LMI: TokenStream, Shape.TGI: TgiStream, Shape.CHAT: ChatStream, Shape.COMPLETION: CompletionStream,
            Shape.RESPONSES: ResponsesStream}


def stream_formatter(plan: RequestPlan, prompt: Prompt,
                     index: int = 0) -> TokenStream | TgiStream | OpenAIStream | ResponsesStream:
    """The formatter of one streamed sequence (choice `index`); its events(out) are that sequence's objects."""
    formatter = _STREAMS[plan.shape](plan, prompt)
    formatter.index = index
    return formatter


# A failed stream's last objects, per dialect (DESIGN §3: a final line with finish_reason "error")
_FAILURES = {Dialect.LMI: lmi_stream_failure, Dialect.OPENAI: openai_stream_failure, Dialect.TGI: tgi_stream_failure}


class StreamAnswer:
    """A streamed answer (plan.stream): each step's objects for all of the prompt's members.

    LMI shapes stream their one sequence as it is. OpenAI shapes stream choice j's chunks with index j
    (members in order, each with its own finish_reason), then once every choice finished the usage chunk
    (stream_options.include_usage: empty choices, prompt once, completion tokens of all choices) and DONE;
    an error in any choice ends the stream with an OpenAI error object and DONE (vLLM).
    """

    def __init__(self, plan: RequestPlan, members: Sequence[Member]):
        """`members`: every prompt's members in order (a list of prompts: prompt p's are members[p*count:
        (p+1)*count]); member j streams as choice j, so prompt p's choices are p*n .. p*n+n-1 (OpenAI, vLLM)."""
        self.plan = plan
        count = plan.sequences.count
        self.streams = {m.request_id: stream_formatter(plan, plan.prompts[j // count], j)
                        for j, m in enumerate(members)}
        self.finished = False

    def events(self, outputs: Mapping[str, RequestOutput]) -> list[Any]:
        """This step's objects; `outputs` holds the step's RequestOutputs by engine request id (others ignored)."""
        events: list[Any] = []
        for request_id, stream in self.streams.items():
            out = outputs.get(request_id)
            if out is None:
                continue
            if self.plan.shape not in OPENAI_SHAPES:     # LMI, TGI, Responses: one sequence, streamed as it is
                self.finished = out.finished
                return stream.events(out)
            if is_error(out):
                self.finished = True
                return [stream.error_document(out), *self.plan.stream_end]
            events.extend(stream.events(out))
        if self.plan.shape in OPENAI_SHAPES and all(f.finished for f in self.streams.values()):
            self.finished = True
            events.extend(stream_tail(self.plan, list(self.streams.values())))
        return events


class Answer:
    """A whole (not streamed) answer: gathers every member's outputs; body() once all finished.

    members[p] are prompt p's engine sequences (protocol/sequences.members).
    """

    def __init__(self, plan: RequestPlan, members: Sequence[Sequence[Member]]):
        self.plan = plan
        details = True if plan.sequences.combine is Combine.BEST_OF else None   # members rank by their details
        self.formatters = [[_DOCUMENTS[plan.shape](plan, prompt, m.params.seed, details) for m in prompt_members]
                           for prompt, prompt_members in zip(plan.prompts, members)]
        self._by_id = {m.request_id: f for prompt_members, fs in zip(members, self.formatters)
                       for m, f in zip(prompt_members, fs)}

    def add(self, out: RequestOutput) -> None:
        """Take one step's output of any member (others' ids are ignored)."""
        formatter = self._by_id.get(out.request_id)
        if formatter is not None:
            formatter.add(out)

    @property
    def done(self) -> bool:
        return all(f.finished for f in self._by_id.values())

    def body(self) -> Any:
        """The answer object: one prompt's document, the dynamic-batch list, or TGI's [document]."""
        documents = [self._prompt_document(fs) for fs in self.formatters]
        if self.plan.kind is Kind.DYNAMIC_LIST:
            return documents
        if len(documents) > 1:               # OpenAI completions with a list of prompts: one document
            return merge_openai_bodies(documents)
        failed = any(f.failed for f in self.formatters[0])
        if self.plan.in_list and not failed:
            return [documents[0]]      # TGI's POST / and tgi_compat wrap the non-streaming answer in a list
        return documents[0]

    def _prompt_document(self, formatters: list[Formatter]) -> dict:
        if self.plan.shape in OPENAI_SHAPES:
            return openai_body(self.plan, formatters)
        if len(formatters) == 1:
            return formatters[0].document()
        failed = [f for f in formatters if f.failed]
        if failed:                      # a member that failed answers for the request
            return failed[0].document()
        return combine_best_of([f.document() for f in formatters], [f.score for f in formatters],
                               [f.seed for f in formatters], self.plan.details)


def response_body(plan: RequestPlan, members: Sequence[Sequence[Member]],
                  outputs: dict[str, Sequence[RequestOutput]]) -> Any:
    """The answer object of a finished request: `members` is plan.members() (the sequences that ran),
    `outputs[member.request_id]` each member's RequestOutputs step by step, the last one finished
    (Engine.generate's result). For an OpenAI plan (chat, completion, batch line) this is the OpenAI
    response body dict; batch output lines embed it as response.body."""
    answer = Answer(plan, members)
    for prompt_members in members:
        for member in prompt_members:
            for out in outputs[member.request_id]:
                answer.add(out)
    return answer.body()


def stream_failure(message: str, code: int, plan: RequestPlan) -> list[Any]:
    """The last objects of a stream whose request failed after HTTP 200 went out (DESIGN §3: a final
    line with finish_reason "error"), in the plan's dialect: OpenAI's error chunk and terminator, as vLLM sends;
    TGI's error event (no terminator: TGI sends none); LMI's final line on the sentinel token."""
    return _FAILURES[plan.dialect](message, code, plan)
