"""Tool calls found in generated text: the model families' formats (option.tool_call_parser, vLLM's names) and
the constrained forms of tool_choice required / named, read whole or as the text streams in.

Owns the formats and the streaming rule (content goes out as soon as it cannot be the start of a call; a call
goes out once it is complete); the response objects are chat_output.py's, the request side tools.py's.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from lmi_handler.protocol.reasoning import held_back
from lmi_handler.protocol.tools import new_call_id

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI sends arguments as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def message(self) -> dict:
        """The call in an assistant message's `tool_calls` (OpenAI)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        """The call whole, as one streamed tool-call delta (OpenAI: index, id, type, function)."""
        return {"index": index, **self.message()}


@dataclass
class Scan:
    """What a parser reads in the text so far: text[:content_end] is content for sure (never the start of a
    call), `calls` the complete calls as (name, arguments object or JSON text), in order. Both only grow as
    the text grows, so a stream can send them as they appear."""

    content_end: int
    calls: list[tuple[str, Any]]


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call(obj: Any, *argument_keys: str) -> tuple[str, Any] | None:
    """(name, arguments) of a {"name", <argument key>} object; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in argument_keys if key in obj), {})
    return obj["name"], arguments


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at text[pos:] and where it ends; None while it is incomplete or not JSON."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _undecided(rest: str, final: bool, *prefixes: str) -> bool:
    """The text is still only (the start of) one of `prefixes`: wait for more, unless it ended."""
    return not final and any(p.startswith(rest) for p in prefixes)


class HermesParser:
    """Hermes / Qwen2.5 / Qwen3 (hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call; the text before the first block is the content (vLLM). An unclosed last block counts
    once the text has ended, if its JSON is complete."""

    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.START)
        if first < 0:
            return Scan(len(text) if final else held_back(text, self.START), [])
        calls, pos = [], first
        while (start := text.find(self.START, pos)) >= 0:
            end = text.find(self.END, start)
            if end < 0 and not final:
                break
            body = text[start + len(self.START):end if end >= 0 else len(text)].strip()
            decoded = _decode(body, 0)
            call = _call(decoded[0], "arguments", "parameters") if decoded else None
            if call is not None:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(self.END)
        return Scan(first, calls)


class Llama3JsonParser:
    """Llama 3.1 / 3.2 JSON tool calls (llama3_json): the output is `{"name": ..., "parameters": {...}}`,
    several joined by `; `, optionally after `<|python_tag|>`. Output that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        pos = _skip_space(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
        rest = text[pos:]
        if _undecided(rest, final, self.TAG, "{"):
            return Scan(0, [])
        if not rest.startswith("{"):
            return Scan(len(text), [])
        calls = []
        while (decoded := _decode(text, pos)) is not None:
            call = _call(decoded[0], "parameters", "arguments")
            if call is None:
                break
            calls.append(call)
            pos = _skip_space(text, decoded[1])
            if not text.startswith(";", pos):
                break
            pos = _skip_space(text, pos + 1)
        return Scan(0, calls)


class MistralParser:
    """Mistral (mistral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11+ tokenizers); the text before is the content. [TOOL_CALLS] is
    a special token in Mistral's tokenizers: send skip_special_tokens=false to keep it in the text."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.START)
        if first < 0:
            return Scan(len(text) if final else held_back(text, self.START), [])
        calls, pos = [], first
        while text.startswith(self.START, pos):
            pos = _skip_space(text, pos + len(self.START))
            if text.startswith("[", pos):
                decoded = _decode(text, pos)
                if decoded is None or not isinstance(decoded[0], list):
                    break
                calls.extend(c for c in (_call(o, "arguments", "parameters") for o in decoded[0]) if c is not None)
            else:
                args = text.find(self.ARGS, pos)
                decoded = _decode(text, args + len(self.ARGS)) if args >= 0 else None
                if decoded is None:
                    break
                calls.append((text[pos:args].strip(), decoded[0]))
            pos = _skip_space(text, decoded[1])
        return Scan(first, calls)


class PythonicParser:
    """Llama 3.2 / Llama 4 pythonic calls (pythonic): the output is a Python list of calls with keyword
    arguments, `[get_weather(city='Paris'), get_time()]`, optionally inside <|python_start|> ... <|python_end|>;
    argument values are Python literals. Output that starts otherwise is content."""

    START = "<|python_start|>"

    def scan(self, text: str, final: bool) -> Scan:
        pos = _skip_space(text, 0)
        if text.startswith(self.START, pos):
            pos = _skip_space(text, pos + len(self.START))
        rest = text[pos:]
        if _undecided(rest, final, self.START, "["):
            return Scan(0, [])
        if not rest.startswith("["):
            return Scan(len(text), [])
        end = rest.find("]")
        while end >= 0:             # the first `]` that closes a whole list is the list's end
            calls = _python_calls(rest[:end + 1])
            if calls is not None:
                return Scan(0, calls)
            end = rest.find("]", end + 1)
        return Scan(0, [])


def _python_calls(source: str) -> list[tuple[str, Any]] | None:
    """The calls of a Python list expression `[f(a=1), g()]`; None when it is not one (yet)."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                                                 and not c.args for c in tree.elts):
        return None
    try:
        return [(c.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in c.keywords}) for c in tree.elts]
    except ValueError:          # a value that is not a literal
        return None


class RequiredParser:
    """tool_choice "required": the constrained output `[{"name": ..., "parameters": {...}}, ...]`
    (tools.ToolRequest.constraint), each element a call as soon as it is complete."""

    def scan(self, text: str, final: bool) -> Scan:  # noqa: ARG002 - one signature for every parser
        pos = _skip_space(text, 0)
        if not text.startswith("[", pos):
            return Scan(0, [])
        calls, pos = [], pos + 1
        while (decoded := _decode(text, _skip_space(text, pos))) is not None:
            call = _call(decoded[0], "parameters")
            if call is None:
                break
            calls.append(call)
            pos = _skip_space(text, decoded[1])
            if not text.startswith(",", pos):
                break
            pos += 1
        return Scan(0, calls)


# option.tool_call_parser: vLLM's and LMI's names
PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
           "pythonic": PythonicParser}


class ToolCallStream:
    """A parser over growing text: feed() each new piece, finish() once at the end; each returns the content
    to send now and the calls completed now, as OpenAI tool-call deltas (each call whole). If the text ends
    with no call found, it was all content (vLLM: output that does not parse is the answer's text)."""

    def __init__(self, parser):
        self.parser = parser
        self.text = ""
        self.sent = 0                  # characters of text sent as content
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        return self._advance(self.parser.scan(self.text, final=False))

    def finish(self) -> tuple[str, list[dict]]:
        scan = self.parser.scan(self.text, final=True)
        if not scan.calls and not self.calls:
            scan = Scan(len(self.text), [])
        return self._advance(scan)

    def _advance(self, scan: Scan) -> tuple[str, list[dict]]:
        content = self.text[self.sent:scan.content_end]
        self.sent = max(self.sent, scan.content_end)
        first = len(self.calls)
        self.calls.extend(ToolCall(name, _arguments_text(args)) for name, args in scan.calls[first:])
        return content, [call.delta(first + i) for i, call in enumerate(self.calls[first:])]


class NamedCallStream:
    """A named tool_choice: the whole (constrained) output is the arguments of one call to `name`; streamed as
    OpenAI does, the first delta with the id, type and name, then argument pieces as they arrive."""

    def __init__(self, name: str):
        self.call = ToolCall(name, "")
        self.started = False

    @property
    def calls(self) -> list[ToolCall]:
        return [self.call]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if not text:
            return "", []
        self.call.arguments += text
        delta = {"index": 0, "function": {"arguments": text}}
        if not self.started:
            self.started = True
            delta = {**self.call.delta(0), "function": {"name": self.call.name, "arguments": text}}
        return "", [delta]

    def finish(self) -> tuple[str, list[dict]]:
        if self.started:
            return "", []
        self.started = True
        return "", [self.call.delta(0)]
