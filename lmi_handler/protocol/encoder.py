"""The one encoder: response objects (dicts, lists) -> the text sent for each wire format.

Owns JSON text as LMI writes it and the framing of json, jsonlines and SSE; what the objects hold is
formatters/'s, which wire a request gets is plan.py's.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Iterable


class Wire(str, enum.Enum):
    """How a request's answer is framed on the wire (LMI: option.output_formatter; OpenAI: stream)."""

    JSON = "json"              # one document
    JSONLINES = "jsonlines"    # one JSON document per line (LMI streaming default)
    SSE = "sse"                # server-sent events, `data: {json}\n\n` (tgi_compat and OpenAI streams)


CONTENT_TYPES = {Wire.JSON: "application/json", Wire.JSONLINES: "application/jsonlines",
                 Wire.SSE: "text/event-stream"}


class _Done:
    """OpenAI's end-of-stream marker: `data: [DONE]` in SSE; jsonlines has none (LMI jsonlines_chat)."""

    def __repr__(self) -> str:
        return "DONE"


DONE = _Done()
SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Event:
    """A named object: under SSE `event: <name>` goes before its data line (the Responses API's stream names
    each event by its type, as OpenAI and vLLM send it); other wires write the data alone."""

    name: str
    data: Any


def dumps(obj: Any) -> str:
    """JSON text as LMI writes it: UTF-8 characters kept, not \\u-escaped."""
    return json.dumps(obj, ensure_ascii=False)


def encode(events: Iterable[Any], wire: Wire) -> str:
    """The text of one step's response objects ("" for none).

    json: the objects' JSON texts back to back (a non-streaming answer is one object);
    jsonlines: each object's JSON and "\\n"; sse: `data: {json}\\n\\n` each. DONE becomes
    `data: [DONE]` under SSE and nothing otherwise; an Event adds its `event:` line under SSE.
    """
    parts = []
    for event in events:
        if event is DONE:
            if wire is Wire.SSE:
                parts.append(SSE_DONE)
        elif isinstance(event, Event):
            named = f"event: {event.name}\n" if wire is Wire.SSE else ""
            parts.append(named + encode([event.data], wire))
        elif wire is Wire.SSE:
            parts.append(f"data: {dumps(event)}\n\n")
        elif wire is Wire.JSONLINES:
            parts.append(dumps(event) + "\n")
        else:
            parts.append(dumps(event))
    return "".join(parts)


def encode_bytes(obj: Any) -> bytes:
    """One JSON document as UTF-8 bytes (DJL entries, HTTP error bodies)."""
    return dumps(obj).encode("utf-8")
