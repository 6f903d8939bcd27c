"""The structured-output workload: a JSON schema per benchmark prompt, and the check of what came back.

Owns the 64 schemas (built here, deterministically, from four templates varied by the prompt's index and
MT-bench category: nested objects, arrays, enums, required keys, bounded strings and arrays), how an
engine's outputs are judged (every one that finished on the grammar's end must parse and validate) and the
round figures both engines report. How each engine runs them is in workers.py and vllm_worker.py.
Plain Python (jsonschema imported where outputs are checked): both venvs import it.
"""
from __future__ import annotations

import json

# MT-bench's categories (benchmarks/data/mt_bench_questions.jsonl), an enum of the first template
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
NUM_TEMPLATES = 4


def _string(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


def schema_for(index: int, question: str, category: str | None = None) -> dict:
    """Prompt `index`'s schema: template index % 4, string bounds by index % 7, array bounds by index % 3 (so
    the 64 schemas are distinct: 4 x 7 x 3 > 64), enums by the category.

    Strings are bounded (maxLength 40-70) and arrays hold at most 2-4 items, so an answer fits in a 128-token
    output; every template has a nested object or an array of objects, an enum and required keys.
    """
    text_len = 40 + 5 * (index % 7)
    max_items = 2 + index % 3
    kind = index % NUM_TEMPLATES
    if kind == 0:   # an outline: a nested object of enums, an array of strings
        return _object({
            "title": _string(text_len),
            "meta": _object({"category": {"type": "string", "enum": list(CATEGORIES)},
                             "confidence": {"type": "string", "enum": ["low", "medium", "high"]}}),
            "key_points": {"type": "array", "items": _string(text_len), "minItems": 1, "maxItems": max_items}})
    if kind == 1:   # an assessment: a nested object with an integer range and an enum array
        return _object({
            "summary": _string(text_len),
            "assessment": _object({
                "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
                "steps": {"type": "integer", "minimum": 1, "maximum": 10},
                "topics": {"type": "array", "items": {"type": "string", "enum": [category or "general", "other"]},
                           "minItems": 1, "maxItems": max_items}}),
            "answer": _string(text_len)})
    if kind == 2:   # a review: nested arrays, a bounded integer, one optional key
        return _object({
            "verdict": {"type": "string", "enum": ["yes", "no", "partly"]},
            "score": {"type": "integer", "minimum": 1, "maximum": 10},
            "details": _object({"pros": {"type": "array", "items": _string(text_len), "maxItems": max_items},
                                "cons": {"type": "array", "items": _string(text_len), "maxItems": max_items}}),
            "note": _string(text_len)}, required=["verdict", "score", "details"])
    return _object({   # entities: an array of objects, a number range, a boolean
        "entities": {"type": "array", "minItems": 1, "maxItems": max_items, "items": _object({
            "name": _string(text_len),
            "kind": {"type": "string", "enum": ["person", "place", "thing", "idea"]},
            "relevance": {"type": "number", "minimum": 0, "maximum": 1}})},
        "question_words": {"type": "integer", "enum": [len(question.split())]},
        "complete": {"type": "boolean"}})


def build_schemas(questions: list[str], categories: list[str | None] | None = None) -> list[dict]:
    """One schema per question, in order (schema_for)."""
    categories = categories or [None] * len(questions)
    return [schema_for(i, q, c) for i, (q, c) in enumerate(zip(questions, categories, strict=True))]


def read_categories(prompts_path, n: int) -> list[str | None]:
    """The MT-bench category of each of the first `n` questions of the prompts file (None where absent)."""
    from pathlib import Path

    lines = [line for line in Path(prompts_path).read_text().splitlines() if line.strip()][:n]
    return [json.loads(line).get("category") for line in lines]


def schema_text(schema: dict) -> str:
    """The schema as the engines get it: canonical JSON text (sorted keys, as protocol/decoding.py writes it)."""
    return json.dumps(schema, sort_keys=True)


def check_outputs(texts: list[str], finished_on_grammar: list[bool], schemas: list[dict]) -> dict:
    """Judge the constrained outputs: of those that finished on the grammar's end (eos after a complete value;
    `finished_on_grammar`), how many parse as JSON and validate against their schema (jsonschema, the
    schema's own draft); the others ran into max_tokens (the text may stop mid-JSON, as in every engine).

    Returns {"num_outputs", "num_finished", "num_length", "num_valid", "num_invalid", "invalid": up to 5
    [index, why]}; num_valid + num_invalid == num_finished.
    """
    import jsonschema

    invalid = []
    for i, (text, done, schema) in enumerate(zip(texts, finished_on_grammar, schemas, strict=True)):
        if not done:
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append([i, f"{type(exc).__name__}: {str(exc)[:200]}"])
    finished = sum(map(bool, finished_on_grammar))
    return {"num_outputs": len(texts), "num_finished": finished, "num_length": len(texts) - finished,
            "num_valid": finished - len(invalid), "num_invalid": len(invalid), "invalid": invalid[:5]}


def run_figures(wall_s: float, token_counts: list[int], num_steps: int | None = None) -> dict:
    """A run's figures: generated tokens (every token an engine returned, the final eos included: each cost
    a step), output tok/s, requests/s, mean tokens per request, and with `num_steps` the mean batch rows."""
    tokens = sum(token_counts)
    out = {"wall_s": wall_s, "num_requests": len(token_counts), "output_tokens": tokens,
           "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(token_counts) / wall_s,
           "mean_tokens_per_request": tokens / len(token_counts) if token_counts else None}
    if num_steps is not None:
        out["num_steps"] = num_steps
    return out


def round_record(constrained: dict, unconstrained: dict, order: str) -> dict:
    """One structured round for round_protocol.serve: the constrained run's figures at the top (its
    output_token_ids kept for the first-round comparison), the unconstrained run beside it, the order they ran."""
    base = {k: v for k, v in unconstrained.items() if k != "output_token_ids"}
    return {**constrained, "unconstrained": base, "order": order,
            "constrained_vs_unconstrained": constrained["output_tokens_per_s"] / base["output_tokens_per_s"]}


def compile_record(first: float, first_plain: float, all_schemas: float, all_plain: float, method: str) -> dict:
    """The compile costs as measured against the same requests unconstrained (wall seconds): the first
    schema's 1-token request, then every request at 2 tokens with its schema."""
    return {"first_request_s": first, "first_request_unconstrained_s": first_plain,
            "first_compile_s": first - first_plain, "all_schemas_2_tokens_s": all_schemas,
            "all_unconstrained_2_tokens_s": all_plain, "all_schemas_compile_s": all_schemas - all_plain,
            "method": method}


def structured_round(k: int, run, schemas: list[dict]) -> dict:
    """Round k of the phase. `run(mode, lengths)` runs every prompt and returns its figures, token ids, texts
    and finished_on_grammar flags, for mode "constrained" (each prompt with its schema), "unconstrained" (the
    same max_tokens, EOS honoured) and "length_matched" (unconstrained, EOS ignored, each request exactly
    `lengths[i]` tokens: as many as its constrained answer, so both runs have the same tokens and the same
    batch sizes step by step, and their ratio is the grammar's cost alone). The first two run in
    round_order(k), then the length-matched one; the constrained outputs are checked (check_outputs).
    Returns round_record's record with "length_matched" and "constrained_vs_length_matched" added."""
    runs = {mode: run(mode, None) for mode in round_order(k)}
    constrained, plain = runs["constrained"], runs["unconstrained"]
    matched = run("length_matched", [len(ids) for ids in constrained["output_token_ids"]])
    constrained["validation"] = check_outputs(constrained.pop("texts"), constrained.pop("finished_on_grammar"), schemas)
    for other in (plain, matched):
        for key in ("texts", "finished_on_grammar", "output_token_ids"):
            other.pop(key, None)
    record = round_record(constrained, plain, ",".join(round_order(k)) + ",length_matched")
    return {**record, "length_matched": matched,
            "constrained_vs_length_matched": constrained["output_tokens_per_s"] / matched["output_tokens_per_s"]}


def round_order(k: int) -> tuple[str, str]:
    """Which run goes first in round k: unconstrained in odd rounds, constrained in even ones."""
    return ("unconstrained", "constrained") if k % 2 else ("constrained", "unconstrained")
