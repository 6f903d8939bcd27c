"""Structured-output specs checked without torch or the tokenizer: the llguidance grammar a spec stands for
(grammar_source) and its validation (check_spec), so the protocol layer can answer 400 for a bad spec
before the request enters the batch without importing torch (STYLE: protocol/ never imports torch).
Compiling against the vocabulary and the per-step masks are grammar.py's.
"""
from __future__ import annotations

import json

from lmi_handler.engine.sequence import GrammarKind, StructuredOutputSpec


class GrammarError(ValueError):
    """A structured-output spec that cannot be enforced: malformed, unsupported, or too large. The message
    says why; the protocol layer names its field."""


def grammar_source(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar for a spec. JSON kinds allow at most spec.max_whitespace whitespace characters
    between tokens (none after the value); choices match exactly one of the strings.

    Raises GrammarError when the value is not even well-formed (JSON text that does not parse, no choices);
    everything else (unsupported keywords, bad regex syntax) is found by check_spec or the compile.
    """
    import llguidance

    options = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{spec.max_whitespace}}}"}
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.value)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.kind is GrammarKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if spec.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind is GrammarKind.CHOICE:
        if not spec.choices:
            raise GrammarError("a choice constraint needs at least one choice")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    return llguidance.LLMatcher.grammar_from_lark(_as_lark(spec.value))


def _as_lark(text: str) -> str:
    """A Lark grammar as it is; GBNF / EBNF (rules written `name ::= ...`, vLLM/xgrammar style) converted."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors for bad input
        raise GrammarError(f"the EBNF grammar does not parse: {exc}") from None


def check_spec(spec: StructuredOutputSpec) -> None:
    """Validate a spec without the tokenizer (fast: no token-level compile), for a 400 before the request
    enters the batch. Raises GrammarError with llguidance's reason (bad regex, unknown JSON schema type or
    format, a Lark syntax error, ...)."""
    import llguidance

    message = llguidance.LLMatcher.validate_grammar(grammar_source(spec))
    if message:
        raise GrammarError(first_lines(message))


def first_lines(message: str, limit: int = 400) -> str:
    text = message.strip()
    return text if len(text) <= limit else text[:limit] + " ..."
