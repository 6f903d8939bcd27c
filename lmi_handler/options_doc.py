"""The options tables of docs/configuration.md, rendered from lmi_handler/config's Settings (its fields, their
types, defaults, ranges and docstrings), one table per part, and the command that writes them there (`make docs`).

Owns the tables' layout only: what an option means is its docstring in its part's module under config/.
"""
from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import SecretStr

from lmi_handler.config import ENVIRONMENT_SWITCHES, PARTS, Settings

START = "<!-- options:start (generated from lmi_handler/config/ by `make docs`; edit the docstrings there) -->"
END = "<!-- options:end -->"
REGENERATE = "make docs  (or: PYTHONPATH=$PWD .venv/bin/python -m lmi_handler.options_doc --write docs/configuration.md)"
# serving.properties keys DJL reads at the top level, not under option.* (read_serving_properties takes both)
TOP_LEVEL_KEYS = ("batch_size", "max_batch_delay", "job_queue_size")
# environment variables that give a key when neither the file nor OPTION_* does (config.read_serving_properties)
DJL_ENVIRONMENT = {"job_queue_size": "SERVING_JOB_QUEUE_SIZE", "tensor_parallel_degree": "TENSOR_PARALLEL_DEGREE"}
HEADER = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]


def render_table() -> str:
    """The Markdown tables between START and END: for each part of the settings (config.PARTS, in order) a
    heading and its docstring, then one row per field of Settings that part holds first, in Settings' order."""
    lines, done = [START], set()
    for part in PARTS:
        title, _, about = (part.__doc__ or part.__name__).partition(": ")
        names = [name for name in Settings.model_fields if name in part.model_fields and name not in done]
        done.update(names)
        lines += [f"### {title}", "", about[:1].upper() + about[1:], "", *HEADER, *map(_row, names), ""]
    return "\n".join([*lines[:-1], END])


def _row(name: str) -> str:
    field = Settings.model_fields[name]
    cells = [_key(name), _type(field.annotation), _default(name, field.default), _range(field),
             _flat(field.description or "")]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def replace_table(text: str) -> str:
    """`text` with the part from START to END replaced by render_table(). Raises ValueError without them."""
    if START not in text or END not in text:
        raise ValueError(f"no options table: the page needs the lines\n{START}\n{END}")
    head, rest = text.split(START, 1)
    return head + render_table() + rest.split(END, 1)[1]


def _key(name: str) -> str:
    key = f"`{name}`" if name in TOP_LEVEL_KEYS else f"`option.{name}`"
    others = [f"`OPTION_{name.upper()}`"]
    others += [f"`{env}`" for env in (ENVIRONMENT_SWITCHES.get(name), DJL_ENVIRONMENT.get(name)) if env]
    return f"{key}<br>{' / '.join(others)}"


def _type(annotation) -> str:
    """int, float, bool, text, secret, one of a set, or several of those; `or unset` when None is allowed."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or unset" if type(None) in args else "")
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if annotation is SecretStr:
        return "secret text"
    return {str: "text", int: "integer", float: "number", bool: "true/false"}.get(annotation, str(annotation))


def _default(name: str, value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`"
    if name.endswith("_bytes") and value >= 1 << 20:
        return f"{value} ({_size(value)})"
    return str(value)


def _size(value: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value % scale == 0:
            return f"{value // scale} {unit}"
    return f"{value / (1 << 20):.0f} MiB"


def _range(field) -> str:
    """The bounds Field(...) enforces: [lo, hi], (lo, hi], >= lo, ...; empty where none are declared."""
    meta = field.metadata
    low = next((("[", b.ge) for b in meta if isinstance(b, annotated_types.Ge)), None) \
        or next((("(", b.gt) for b in meta if isinstance(b, annotated_types.Gt)), None)
    high = next((("]", b.le) for b in meta if isinstance(b, annotated_types.Le)), None) \
        or next(((")", b.lt) for b in meta if isinstance(b, annotated_types.Lt)), None)
    if low and high:
        return f"{low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
    if low:
        return f"{'≥' if low[0] == '[' else '>'} {_number(low[1])}"
    if high:
        return f"{'≤' if high[0] == ']' else '<'} {_number(high[1])}"
    return ""


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flat(doc: str) -> str:
    return " ".join(doc.split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmi_handler.options_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, metavar="PAGE",
                        help="replace the table between the option markers in PAGE (docs/configuration.md)")
    args = parser.parse_args(argv)
    if args.write is None:
        print(render_table())
        return 0
    try:
        args.write.write_text(replace_table(args.write.read_text(encoding="utf-8")), encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"options table written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
