"""Tool calling on the wire: `tools`, `tool_choice` (and the legacy `functions` / `function_call`) checked
into a ToolRequest, and the JSON-schema constraint that `required` and a named tool decode under.

Owns the request side only: finding calls in generated text is tool_parsers.py's, the response shapes are
chat_output.py's, and whether `auto` is served (option.enable_auto_tool_choice) is the service's rule.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lmi_handler.engine.grammar_spec import GrammarError, check_spec
from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec
from lmi_handler.protocol.errors import RequestValidationError, show_value

TOOL_CHOICES = ("none", "auto", "required")
# A tool without `parameters` takes no arguments (OpenAI): its arguments are an empty object
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _bad(field: str, message: str) -> RequestValidationError:
    return RequestValidationError(field, f"Invalid parameter `{field}`: {message}")


def new_call_id() -> str:
    """A tool call's id: `call_` and 24 hex digits (OpenAI's prefix; unique per call)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and what it asks of them.

    `functions` are the tools' function objects {name, description?, parameters?} as sent (the chat
    template gets them as OpenAI tools); `mode` is none | auto | required | named (`name` then names the
    function); `legacy` marks a request that sent `functions` (its answer also carries `function_call`);
    `parallel` is parallel_tool_calls (false: `required` makes exactly one call).
    """

    functions: tuple[dict, ...]
    mode: str
    name: str | None = None
    legacy: bool = False
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """`required` and a named tool decode under the tools' JSON schemas."""
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (transformers: OpenAI's {"type": "function", "function"})."""
        return [{"type": "function", "function": f} for f in self.functions]

    def parameters(self, name: str) -> dict:
        function = next(f for f in self.functions if f["name"] == name)
        return function.get("parameters") or NO_PARAMETERS

    def constraint(self) -> StructuredOutputSpec:
        """The JSON schema the output decodes under (vLLM's forms): a named tool's output is its arguments
        object; `required`'s a non-empty array of {"name", "parameters"}, one of the tools each (one item
        when parallel is false). Only for constrained modes."""
        if self.mode == "named":
            schema = self.parameters(self.name)
        else:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                  "parameters": self.parameters(f["name"])},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for f in self.functions]}}
            if not self.parallel:
                schema["maxItems"] = 1
        return StructuredOutputSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True))


def parse_tool_request(given: dict[str, Any]) -> ToolRequest | None:
    """The tool fields of a chat body (`given`: field -> value as sent, nulls left out): `tools` and
    `tool_choice`, or the legacy `functions` and `function_call` (not both kinds); None when the request
    has no tools and asks for none. tool_choice defaults to "auto" with tools, "none" without (OpenAI).

    Raises RequestValidationError naming the field: a tool that is not {"type": "function", "function":
    {"name", "description"?, "parameters"?}}, parameters that are not a JSON Schema, two tools of one name,
    a tool_choice outside none | auto | required | {"type": "function", "function": {"name"}}, a named tool
    not among the tools, `required` or a named tool with no tools, and (for the modes that constrain the
    output) a schema llguidance cannot enforce.
    """
    legacy = "functions" in given or "function_call" in given
    if legacy and ("tools" in given or "tool_choice" in given):
        field = "functions" if "functions" in given else "function_call"
        raise _bad(field, "send either tools and tool_choice or the legacy functions and function_call, not both")
    if legacy:
        functions = _legacy_functions(given.get("functions", []))
        choice_field, name_field = "function_call", "function_call.name"
        choice = _legacy_choice(given.get("function_call"))
    else:
        functions = _functions(given.get("tools", []))
        choice_field, name_field = "tool_choice", "tool_choice.function.name"
        choice = given.get("tool_choice")
    mode, name = _choice(choice, choice_field, name_field, functions)
    if not functions and mode == "none":
        return None
    parallel = given.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestValidationError.out_of_range("parallel_tool_calls", parallel, "true or false")
    request = ToolRequest(tuple(functions), mode, name, legacy, parallel)
    if request.constrained:
        try:
            check_spec(request.constraint())
        except GrammarError as exc:
            where = ("functions" if legacy else "tools") if mode == "required" else name_field
            raise _bad(where, f"the tools' JSON schemas cannot be enforced for tool_choice {mode!r}: {exc}") from None
    return request


def _functions(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestValidationError.out_of_range("tools", tools, 'a list of {"type": "function", "function": '
                                                  '{"name", "description"?, "parameters"?}}')
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}]", f'must be {{"type": "function", "function": {{...}}}}, got {show_value(tool)}')
        functions.append(_function(tool.get("function"), f"tools[{i}].function"))
    _check_unique(functions, "tools")
    return functions


def _legacy_functions(functions: Any) -> list[dict]:
    if not isinstance(functions, list):
        raise RequestValidationError.out_of_range("functions", functions, "a list of {name, description?, "
                                                  "parameters?}")
    out = [_function(f, f"functions[{i}]") for i, f in enumerate(functions)]
    _check_unique(out, "functions")
    return out


def _function(function: Any, where: str) -> dict:
    """One function object checked: a non-empty name, a string description, parameters a JSON Schema object."""
    if not isinstance(function, dict):
        raise _bad(where, f"must be an object {{name, description?, parameters?}}, got {show_value(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name", f"must be a non-empty string, got {show_value(name)}")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise _bad(f"{where}.description", f"must be a string, got {show_value(function['description'])}")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_schema(parameters, f"{where}.parameters")
    return function


def _check_schema(schema: Any, where: str) -> None:
    """A JSON Schema object, checked against its draft's metaschema (2020-12 unless `$schema` names one)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _bad(where, f"must be a JSON Schema object, got {show_value(schema)}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise _bad(where + path, f"not a valid JSON Schema: {exc.message}") from None


def _check_unique(functions: list[dict], field: str) -> None:
    names = [f["name"] for f in functions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _bad(field, f"function names must be unique, {twice[0]!r} is given twice")


def _legacy_choice(function_call: Any) -> Any:
    """Legacy function_call -> tool_choice: "none" | "auto" | {"name"} (a named function)."""
    if isinstance(function_call, dict) and "name" in function_call:
        return {"type": "function", "function": {"name": function_call["name"]}}
    return function_call


def _choice(choice: Any, field: str, name_field: str, functions: list[dict]) -> tuple[str, str | None]:
    """(mode, name) of a tool_choice; the default is auto with tools, none without (OpenAI), and auto without
    tools is none."""
    if choice is None or (choice == "auto" and not functions):      # auto with nothing to call: none
        return ("auto" if functions else "none"), None
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        if choice == "required" and not functions:
            raise _bad(field, '"required" needs at least one tool in `tools`')
        return choice, None
    allowed = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(field, f"must be {allowed}, got {show_value(choice)}")
    name = function["name"]
    known = [f["name"] for f in functions]
    if name not in known:
        listed = ", ".join(map(repr, known)) or "none were sent"
        raise _bad(name_field, f"names no tool of this request: {name!r} (tools: {listed})")
    return "named", name
