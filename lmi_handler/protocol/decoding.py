"""Decoding controls on the wire: structured-output constraints in each dialect's shape, beam search and
the logits controls, checked and turned into the engine's SamplingParams fields.

Owns which request fields carry a constraint (OpenAI `response_format`, vLLM `structured_outputs`, TGI
`grammar`, the legacy `guided_*`), the one-constraint rule, and the spec checks that answer 400 before a
request enters the batch (grammar.check_spec: llguidance's own validation, no tokenizer). Token-level work
(bad words to ids, vocabulary bounds) needs the model's tokenizer and is service.py's.
"""
from __future__ import annotations

import json
from typing import Any

from lmi_handler.engine.grammar_spec import GrammarError, check_spec
from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec
from lmi_handler.protocol.errors import RequestValidationError, show_value

# The fields a structured-output constraint may arrive in, in the order they are named in errors.
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "grammar", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
# vLLM StructuredOutputsParams: exactly one of these
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options beside the constraint: disable_any_whitespace is honoured (no whitespace between JSON tokens);
# the backend choices are the server's (llguidance here), so they change nothing the client can see
_STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                       "whitespace_pattern", "backend")
_TGI_GRAMMAR_TYPES = ("json", "json_object", "regex", "json_schema")
MAX_LOGIT_BIAS = 100.0          # OpenAI: bias values in [-100, 100]


def _bad(field: str, message: str) -> RequestValidationError:
    return RequestValidationError(field, f"Invalid parameter `{field}`: {message}")


def structured_output(given: dict[str, Any]) -> tuple[str, StructuredOutputSpec] | None:
    """The one constraint among `given` (field name -> value as sent, nulls left out), as (the field to name
    in errors, the engine's spec); None when no field asks for one (`response_format` {"type": "text"}).

    An empty value ({}, [], "") counts as not given, as clients send them for "none". Raises
    RequestValidationError naming the field: two constraints at once, a shape the field's owner does
    not define, or a schema / regex / grammar llguidance refuses (with its reason).
    """
    found = []
    for name in CONSTRAINT_FIELDS:
        if name in given and given[name] not in ({}, [], ""):    # empty = not given (clients send defaults)
            spec = _PARSERS[name](given[name], name)
            if spec is not None:
                found.append((name, spec))
    if len(found) > 1:
        names = " and ".join(f"`{name}`" for name, _ in found)
        raise RequestValidationError(found[1][0], f"Invalid parameter `{found[1][0]}`: one structured-output "
                                     f"constraint per request, got {names}")
    if not found:
        return None
    field, spec = found[0]
    try:
        check_spec(spec)
    except GrammarError as exc:
        raise _bad(field, f"{_what(spec)} cannot be enforced: {exc}") from None
    return field, spec


def _what(spec: StructuredOutputSpec) -> str:
    return {GrammarKind.JSON_SCHEMA: "the JSON schema", GrammarKind.JSON_OBJECT: "json_object",
            GrammarKind.REGEX: "the regex", GrammarKind.CHOICE: "the choice",
            GrammarKind.GRAMMAR: "the grammar"}[spec.kind]


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object (or boolean) or as JSON text, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _bad(field, f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise _bad(field, f"must be a JSON schema (an object), got {show_value(value)}")
    return json.dumps(value, sort_keys=True)


def _text(value: Any, field: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(field, f"must be a non-empty string ({what}), got {show_value(value)}")
    return value


def _choices(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(field, f"must be a non-empty list of non-empty strings, got {show_value(value)}")
    return tuple(value)


def _response_format(value: Any, field: str) -> StructuredOutputSpec | None:
    """OpenAI response_format: {"type": "text"} (no constraint), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}."""
    if not isinstance(value, dict) or "type" not in value:
        raise _bad(field, 'must be an object {"type": "text" | "json_object" | "json_schema", ...}, got '
                   f"{show_value(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(GrammarKind.JSON_OBJECT)
    if kind != "json_schema":
        raise _bad(f"{field}.type", f'must be "text", "json_object" or "json_schema", got {show_value(kind)}')
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise _bad(f"{field}.json_schema", "required with type json_schema: an object {name, schema, strict?}")
    if not isinstance(inner.get("name"), str) or not inner["name"]:
        raise _bad(f"{field}.json_schema.name", f"must be a non-empty string, got {show_value(inner.get('name'))}")
    if inner.get("schema") is None:        # OpenAI allows it out: then any JSON object (vLLM the same)
        return StructuredOutputSpec(GrammarKind.JSON_OBJECT)
    return StructuredOutputSpec(GrammarKind.JSON_SCHEMA, _schema_text(inner["schema"], f"{field}.json_schema.schema"))


def _structured_outputs(value: Any, field: str) -> StructuredOutputSpec | None:
    """vLLM structured_outputs: exactly one of json, regex, choice, grammar, json_object (true)."""
    if not isinstance(value, dict):
        raise _bad(field, f"must be an object with one of {', '.join(_STRUCTURED_KINDS)}, got {show_value(value)}")
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS) - set(_STRUCTURED_OPTIONS))
    if unknown:
        raise _bad(f"{field}.{unknown[0]}", f"not supported here (one of {', '.join(_STRUCTURED_KINDS)}, "
                   "and disable_any_whitespace)")
    kinds = [k for k in _STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise _bad(field, f"needs exactly one of {', '.join(_STRUCTURED_KINDS)}, got "
                   f"{', '.join(kinds) if kinds else 'none'}")
    (kind,) = kinds
    where = f"{field}.{kind}"
    whitespace = 0 if value.get("disable_any_whitespace") is True else StructuredOutputSpec.max_whitespace
    if kind == "json":
        return StructuredOutputSpec(GrammarKind.JSON_SCHEMA, _schema_text(value[kind], where), max_whitespace=whitespace)
    if kind == "json_object":
        if value[kind] is not True:
            raise _bad(where, f"must be true, got {show_value(value[kind])}")
        return StructuredOutputSpec(GrammarKind.JSON_OBJECT, max_whitespace=whitespace)
    if kind == "regex":
        return StructuredOutputSpec(GrammarKind.REGEX, _text(value[kind], where, "a regular expression"))
    if kind == "choice":
        return StructuredOutputSpec(GrammarKind.CHOICE, choices=_choices(value[kind], where))
    return StructuredOutputSpec(GrammarKind.GRAMMAR, _text(value[kind], where, "a Lark or EBNF grammar"))


def _tgi_grammar(value: Any, field: str) -> StructuredOutputSpec | None:
    """TGI parameters.grammar: {"type": "json" | "json_object", "value": schema}, {"type": "regex", "value":
    pattern}, {"type": "json_schema", "value": {"name"?, "schema"}} (TGI's GrammarType)."""
    if not isinstance(value, dict) or "type" not in value:
        raise _bad(field, f'must be an object {{"type": {" | ".join(_TGI_GRAMMAR_TYPES)}, "value"}}, '
                   f"got {show_value(value)}")
    kind, inner = value["type"], value.get("value")
    if kind not in _TGI_GRAMMAR_TYPES:
        raise _bad(f"{field}.type", f"must be one of {', '.join(_TGI_GRAMMAR_TYPES)}, got {show_value(kind)}")
    where = f"{field}.value"
    if kind == "regex":
        return StructuredOutputSpec(GrammarKind.REGEX, _text(inner, where, "a regular expression"))
    if kind == "json_schema":
        if not isinstance(inner, dict) or inner.get("schema") is None:
            raise _bad(where, f'must be an object {{"name"?, "schema"}}, got {show_value(inner)}')
        return StructuredOutputSpec(GrammarKind.JSON_SCHEMA, _schema_text(inner["schema"], f"{where}.schema"))
    if inner is None and kind == "json_object":
        return StructuredOutputSpec(GrammarKind.JSON_OBJECT)
    if inner is None:
        raise _bad(where, "required: the JSON schema")
    return StructuredOutputSpec(GrammarKind.JSON_SCHEMA, _schema_text(inner, where))


_PARSERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "grammar": _tgi_grammar,
    "guided_json": lambda v, f: StructuredOutputSpec(GrammarKind.JSON_SCHEMA, _schema_text(v, f)),
    "guided_regex": lambda v, f: StructuredOutputSpec(GrammarKind.REGEX, _text(v, f, "a regular expression")),
    "guided_choice": lambda v, f: StructuredOutputSpec(GrammarKind.CHOICE, choices=_choices(v, f)),
    "guided_grammar": lambda v, f: StructuredOutputSpec(GrammarKind.GRAMMAR, _text(v, f, "a Lark or EBNF grammar")),
}


def logit_bias(value: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI logit_bias {"token id": bias} -> ((id, bias), ...) sorted by id; bias in [-100, 100] (OpenAI).
    Ids are checked against the vocabulary later (service.py). Raises RequestValidationError("logit_bias")."""
    if not value:
        return ()
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise _bad("logit_bias", f"keys must be token ids (integers as strings), got {show_value(key)}") from None
        if token < 0 or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"must map token ids >= 0 to numbers in [-100, 100], got "
                       f"{show_value(key)}: {show_value(bias)}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))
