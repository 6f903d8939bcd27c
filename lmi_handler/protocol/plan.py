"""RequestPlan: everything about one request's answer, decided once when the request is parsed.

Owns the rules that pick a request's kind, whether it streams, its wire format and content type;
building a plan from bytes (tokenizing, length checks) is service.py's, filling it formatters/'s.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from lmi_handler.engine.sequence import SamplingParams
from lmi_handler.protocol.chat_output import ChatOutputRule
from lmi_handler.protocol.custom_output import CustomOutputRule
from lmi_handler.protocol.dialects import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_GENERATE,
    ROUTE_GENERATE_STREAM,
    ROUTE_RESPONSES,
    ROUTE_TGI,
    Dialect,
)
from lmi_handler.protocol.encoder import CONTENT_TYPES, DONE, Wire
from lmi_handler.protocol.responses import ResponsesContext
from lmi_handler.protocol.sequences import SINGLE, Member, SequencePlan, members

DecodeToken = Callable[[int], str]


class Kind(str, enum.Enum):
    """What was asked, by which route and schema."""

    LMI_TEXT = "lmi_text"                    # /invocations {"inputs": str}
    LMI_CHAT = "lmi_chat"                    # /invocations {"messages"}: OpenAI objects, LMI stream formats
    OPENAI_CHAT = "openai_chat"              # /v1/chat/completions
    OPENAI_COMPLETION = "openai_completion"  # /v1/completions
    OPENAI_RESPONSES = "openai_responses"    # /v1/responses: run as a chat, answered as a Response
    DYNAMIC_LIST = "dynamic_list"            # /invocations in dynamic batch: a list, one element per input
    BATCH_LINE = "batch_line"                # one line of a batch file: the OpenAI body its url answers
    TGI_GENERATE = "tgi_generate"            # TGI /generate
    TGI_STREAM = "tgi_stream"                # TGI /generate_stream: always SSE
    TGI_COMPAT = "tgi_compat"                # TGI POST /: /generate_stream when stream=true, else [/generate]


class Shape(str, enum.Enum):
    """The response object one sequence becomes (formatters/ has one formatter per shape and mode)."""

    LMI = "lmi"                # {"generated_text", "details"?}; streamed as {"token"} lines
    TGI = "tgi"                # TGI {"generated_text", "details": {..., "seed"}}; streamed as TGI StreamResponses
    CHAT = "chat"              # chat.completion; streamed as chat.completion.chunk
    COMPLETION = "completion"  # text_completion (also its chunks)
    RESPONSES = "responses"    # a Response object; streamed as its named events (formatters/responses.py)


OPENAI_KINDS = (Kind.OPENAI_CHAT, Kind.OPENAI_COMPLETION, Kind.OPENAI_RESPONSES, Kind.BATCH_LINE)
TGI_KINDS = (Kind.TGI_GENERATE, Kind.TGI_STREAM, Kind.TGI_COMPAT)
_TGI_ROUTES = {ROUTE_GENERATE: Kind.TGI_GENERATE, ROUTE_GENERATE_STREAM: Kind.TGI_STREAM, ROUTE_TGI: Kind.TGI_COMPAT}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, ready for the engine (a list of `inputs` gives several)."""

    request_id: str              # engine request id: the request's, or "{id}-{i}" for the i-th input
    text: str                    # the prompt as rendered (chat template applied)
    token_ids: tuple[int, ...]
    params: SamplingParams       # trusted knobs (protocol/params.py); seed resolved per member later


@dataclass(frozen=True)
class RequestPlan:
    """A validated request and how to answer it; every later stage reads it, none decides again.

    `tgi_names`: TGI's token names ({logprob, special}) and, for LMI json, the answer wrapped in a list
    (option.tgi_compat). `created` is unix seconds. `decode_token` gives texts of top-token alternatives.
    """

    request_id: str
    kind: Kind
    shape: Shape
    wire: Wire
    stream: bool
    prompts: tuple[Prompt, ...]
    sequences: SequencePlan = SINGLE
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    tgi_names: bool = False
    logprobs: bool = False
    include_usage: bool = False
    model_name: str = ""
    sse_done: bool = True        # OpenAI streams end with `data: [DONE]`; not under tgi_compat (sse_done_marker)
    created: int = 0
    constraint_field: str | None = None   # where the structured-output constraint came (a compile error's 400 names it)
    prompt_logprobs: bool = False         # vLLM prompt_logprobs on the OpenAI shapes
    echo_only: bool = False               # completions echo with max_tokens 0: the prompt alone (one token runs)
    chat_output: ChatOutputRule | None = None   # chat: reasoning and tool calls to find in the text (chat_output.py)
    responses: ResponsesContext | None = field(default=None, compare=False)   # /v1/responses: its id, echo, store
    custom_output: CustomOutputRule | None = None   # LMI text: model.py's output formatter answers (custom_output.py)
    decode_token: DecodeToken | None = field(default=None, compare=False, repr=False)

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.wire]

    @property
    def priority(self) -> int:
        """The request's `priority` (its prompts share it): lower waits less (option.scheduling_policy)."""
        return self.prompts[0].params.priority if self.prompts else 0

    @property
    def dialect(self) -> Dialect:
        """Whose shapes the answer and its errors take (a batch line answers as its OpenAI route)."""
        if self.kind in OPENAI_KINDS:
            return Dialect.OPENAI
        return Dialect.TGI if self.kind in TGI_KINDS else Dialect.LMI

    @property
    def stream_end(self) -> tuple:
        """What ends a stream of OpenAI chunks (chat and completion shapes, LMI chat included) after its last
        one: encoder.DONE (`data: [DONE]` under SSE, nothing in jsonlines), unless the plan leaves it out
        (sse_done_marker: tgi_compat). A Responses stream ends with its response.completed event alone (OpenAI).
        The one place the terminator rule is written."""
        return (DONE,) if self.sse_done and self.kind is not Kind.OPENAI_RESPONSES else ()

    @property
    def in_list(self) -> bool:
        """A whole answer sent as a one-element list: TGI's POST / (TGI), LMI text under tgi_compat (LMI)."""
        return self.kind is Kind.TGI_COMPAT or (self.kind is Kind.LMI_TEXT and self.tgi_names)

    def members(self, front_end_seed: int | None = None) -> list[list[Member]]:
        """The engine sequences of each prompt (n / best_of; seeds resolved now, see sequences.members)."""
        return [members(p.request_id, p.params, self.sequences, front_end_seed) for p in self.prompts]


def kind_of(route: str | None, chat: bool, rolling: bool) -> Kind:
    """The kind of a parsed request: by route, then `messages` (LMI chat), then the batching mode."""
    if route == ROUTE_CHAT:
        return Kind.OPENAI_CHAT
    if route == ROUTE_COMPLETIONS:
        return Kind.OPENAI_COMPLETION
    if route == ROUTE_RESPONSES:
        return Kind.OPENAI_RESPONSES
    if route in _TGI_ROUTES:
        return _TGI_ROUTES[route]
    if chat:
        return Kind.LMI_CHAT
    return Kind.LMI_TEXT if rolling else Kind.DYNAMIC_LIST


def shape_of(kind: Kind, route: str | None = None) -> Shape:
    """The response object of a kind; a batch line answers its url's OpenAI object."""
    if kind in (Kind.LMI_CHAT, Kind.OPENAI_CHAT) or (kind is Kind.BATCH_LINE and route == ROUTE_CHAT):
        return Shape.CHAT
    if kind is Kind.OPENAI_RESPONSES:
        return Shape.RESPONSES
    if kind in (Kind.OPENAI_COMPLETION, Kind.BATCH_LINE):
        return Shape.COMPLETION
    return Shape.TGI if kind in TGI_KINDS else Shape.LMI


def streaming_reason(kind: Kind, asked: bool, output_formatter: str | None, *, rolling: bool = True,
                     enable_streaming: bool = False) -> str | None:
    """Why the answer streams, in words for error messages; None when it does not.

    Batch lines and TGI /generate never stream. Rolling batch: `stream: true`; TGI /generate_stream always;
    LMI kinds with option.output_formatter=jsonlines|sse or option.enable_streaming=true. Dynamic batch:
    `stream: true`, or a list of inputs with option.enable_streaming=true (LMI schema: {"outputs"} lines).
    """
    if kind in (Kind.BATCH_LINE, Kind.TGI_GENERATE):
        return None
    if kind is Kind.TGI_STREAM and rolling:
        return "/generate_stream always streams (use /generate)"
    if asked:
        return "send stream=false"
    enabled = "option.enable_streaming=true streams every response here"
    if not rolling:
        return enabled if kind is Kind.DYNAMIC_LIST and enable_streaming else None
    if kind in (Kind.LMI_TEXT, Kind.LMI_CHAT) and output_formatter in ("jsonlines", "sse"):
        return f"option.output_formatter={output_formatter} streams every response here"
    if kind in (Kind.LMI_TEXT, Kind.LMI_CHAT) and enable_streaming:
        return enabled
    return None


def wire_of(kind: Kind, stream: bool, output_formatter: str | None, tgi_compat: bool) -> Wire:
    """json when not streaming; SSE on OpenAI and TGI routes; {"outputs"} jsonlines in dynamic batch; else
    option.output_formatter, else SSE with tgi_compat, else jsonlines (LMI defaults)."""
    if not stream:
        return Wire.JSON
    if kind in OPENAI_KINDS or kind in TGI_KINDS:
        return Wire.SSE
    if kind is Kind.DYNAMIC_LIST:
        return Wire.JSONLINES
    if output_formatter and output_formatter != "json":
        return Wire(output_formatter)
    return Wire.SSE if tgi_compat else Wire.JSONLINES


def tgi_names(kind: Kind, tgi_compat: bool) -> bool:
    """TGI's token names (and list-wrapped LMI json): always on TGI routes; for LMI text under tgi_compat."""
    return kind in TGI_KINDS or (tgi_compat and kind is Kind.LMI_TEXT)


def details_by_default(kind: Kind, tgi_compat: bool) -> bool:
    """`details` when the request does not say: on under tgi_compat (LMI), off on TGI routes (TGI)."""
    return tgi_compat and kind not in TGI_KINDS


def sse_done_marker(tgi_compat: bool) -> bool:
    """OpenAI streams end with `data: [DONE]` (OpenAI, vLLM); under tgi_compat they just end, as TGI 2.0 did:
    the TGI client (text-generation 0.7.0) fails on the marker, and the openai package and huggingface_hub
    stop at the stream's end either way."""
    return not tgi_compat
