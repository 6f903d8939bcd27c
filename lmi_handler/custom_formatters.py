"""LMI's model.py formatters: found at load by their marks, the base model's and each adapter's.

Owns importing a model.py (with a stand-in for its djl_python imports where djl_python is not installed),
finding its @input_formatter / @output_formatter functions (or the one option.output_formatter names), and
which one answers a request's adapter. Which requests get them is service.py's; a formatter at work on a
request is protocol/custom_output.py's.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import logging
import re
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from lmi_handler.config import ConfigError
from lmi_handler.protocol.custom_output import CustomOutputRule, FormatterError
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.params import GenerationParameters

logger = logging.getLogger(__name__)

MODEL_CODE = "model.py"
INPUT_MARK = "is_input_formatter"        # what djl_python.input_parser.input_formatter sets (and ours)
OUTPUT_MARK = "is_output_formatter"      # what djl_python.output_formatter.output_formatter sets (and ours)
BUILTIN_OUTPUT_FORMATTERS = ("json", "jsonlines", "sse")
# The djl_python modules LMI's formatter docs import from, and this package's equivalents.
STAND_INS = {"djl_python.input_parser": "lmi_handler.input_parser",
             "djl_python.output_formatter": "lmi_handler.output_formatter",
             "djl_python.request_io": "lmi_handler.request_io"}


class ModelCodeError(ConfigError):
    """A model.py that cannot be imported, or whose formatters are ambiguous: start-up is refused."""


@dataclass(frozen=True)
class ModelCode:
    """One imported model.py: its marked formatters and every function it defines (option.output_formatter)."""

    path: Path
    input_formatter: Callable | None
    output_formatter: Callable | None
    functions: dict[str, Callable]


class _DjlPythonStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers model.py's `djl_python.input_parser`, `.output_formatter` and `.request_io` imports with fresh
    modules holding this package's equivalents (same names); any other djl_python import fails as it would.
    `made` keeps the modules it made, so they can be taken out of sys.modules again."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None):  # noqa: ARG002 - the finder protocol
        if name == "djl_python" or name in STAND_INS:
            return importlib.util.spec_from_loader(name, self, is_package=name == "djl_python")
        return None

    def create_module(self, spec):  # noqa: ARG002 - the loader protocol
        return None        # a plain new module

    def exec_module(self, module) -> None:
        name = module.__name__
        module.__doc__ = f"lmi_handler's stand-in for {name} (djl_python is not installed)"
        self.made.append(module)
        if name in STAND_INS:
            ours = importlib.import_module(STAND_INS[name])
            module.__dict__.update({k: v for k, v in vars(ours).items() if not k.startswith("_")})
            logger.info("djl_python is not installed: model.py's `import %s` gets %s", name, STAND_INS[name])


@contextmanager
def _djl_python_for_model_code() -> Iterator[None]:
    """While a model.py is imported: the real djl_python where it is installed, else the stand-in, removed
    again afterwards (sys.modules keeps no djl_python of ours: the rest of the process never sees one)."""
    if _installed("djl_python"):
        yield
        return
    finder = _DjlPythonStandIn()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for module in finder.made:
            if sys.modules.get(module.__name__) is module:
                del sys.modules[module.__name__]


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:        # a finder that refuses the name
        return False


def _marked(functions: dict[str, Callable], mark: str, path: Path) -> Callable | None:
    found = [f for f in dict.fromkeys(functions.values()) if getattr(f, mark, False) is True]
    if len(found) > 1:
        names = ", ".join(f.__name__ for f in found)
        raise ModelCodeError(f"{path} marks {len(found)} functions as {mark[3:]} ({names}): keep one")
    return found[0] if found else None


def load_model_code(folder: Path, namespace: str) -> ModelCode | None:
    """Import `folder`/model.py (None when there is none) under a module name of its own (`namespace`: the
    base model or an adapter), its folder first on sys.path while it imports, as LMI imports it.
    Raises ModelCodeError with the traceback's last line when it cannot be imported (the whole traceback
    goes to the log)."""
    path = folder / MODEL_CODE
    if not path.is_file():
        return None
    module_name = "lmi_model_code_" + re.sub(r"\W", "_", namespace)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module          # what dataclasses and pickling in model.py look up
    sys.path.insert(0, str(folder))
    try:
        with _djl_python_for_model_code():
            spec.loader.exec_module(module)
    except BaseException as exc:  # user code: SystemExit and the like refuse start-up too
        sys.modules.pop(module_name, None)
        logger.error("%s cannot be imported", path, exc_info=exc)
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise ModelCodeError(f"{path} cannot be imported: {last}") from None
    finally:
        sys.path.remove(str(folder))
    functions = {name: f for name, f in vars(module).items() if inspect.isfunction(f)}
    code = ModelCode(path, _marked(functions, INPUT_MARK, path), _marked(functions, OUTPUT_MARK, path), functions)
    logger.info("%s: input formatter %s, output formatter %s", path, _name(code.input_formatter),
                _name(code.output_formatter))
    return code


def _name(function: Callable | None) -> str:
    return function.__name__ if function is not None else "none"


class CustomFormatters:
    """The base model's formatters and each adapter's (an adapter's model.py wins for its requests, LMI's rule).

    `output_option`: option.output_formatter; a name other than json, jsonlines and sse names the base
    model.py's output formatter. Raises ModelCodeError (a ConfigError) for a name model.py does not define.
    """

    def __init__(self, base: ModelCode | None, output_option: str | None = None):
        self.base = base
        self.adapters: dict[str, ModelCode] = {}
        self.base_output = base.output_formatter if base is not None else None
        if output_option is not None and output_option not in BUILTIN_OUTPUT_FORMATTERS:
            named = base.functions.get(output_option) if base is not None else None
            if named is None:
                where = f"{base.path} defines no function of that name" if base else "there is no model.py"
                raise ModelCodeError(f"option.output_formatter={output_option!r}: not one of "
                                     f"{', '.join(BUILTIN_OUTPUT_FORMATTERS)}, and {where}")
            self.base_output = named

    @classmethod
    def load(cls, folders: list[Path], output_option: str | None) -> "CustomFormatters":
        """The first model.py of `folders` (DJL's model_dir, then the checkpoint's folder). Raises ModelCodeError."""
        for folder in dict.fromkeys(p.resolve() for p in folders):
            code = load_model_code(folder, "base")
            if code is not None:
                return cls(code, output_option)
        return cls(None, output_option)

    @property
    def any_input(self) -> bool:
        codes = [self.base, *self.adapters.values()]
        return any(c is not None and c.input_formatter is not None for c in codes)

    @property
    def any_output(self) -> bool:
        return self.base_output is not None or any(c.output_formatter for c in self.adapters.values())

    def check_batching(self, rolling: bool) -> None:
        """Raises ModelCodeError for an output formatter under dynamic batch (its answers are whole lists)."""
        if self.any_output and not rolling:
            raise ModelCodeError("model.py's output formatter needs the rolling batch (LMI calls it at each step of "
                                 "a request): set option.rolling_batch, or remove the formatter")

    def output_rule(self, adapter: str | None, params: GenerationParameters,
                    num_sequences: int) -> CustomOutputRule | None:
        """The output formatter answering a request naming `adapter` (None: the base), with the request's
        parameters. LMI's formatters answer one sequence: raises RequestValidationError (400) for n, best_of or
        num_beams above 1."""
        formatter = self.output_for(adapter)
        if formatter is None:
            return None
        if num_sequences > 1 or params.num_beams > 1:
            field = "num_beams" if params.num_beams > 1 else "best_of" if (params.best_of or 1) > 1 else "n"
            raise RequestValidationError(field, f"Invalid parameter `{field}`: model.py's output formatter "
                                         f"{formatter.__name__} answers one sequence (LMI's custom formatters)")
        return CustomOutputRule(formatter, params.model_dump(exclude_unset=True))

    def load_adapter(self, name: str, folder: Path) -> None:
        """The adapter's own model.py, if it has one (a name loaded again drops its old one). Raises
        ModelCodeError (nothing changes then)."""
        code = load_model_code(Path(folder), f"adapter_{name}")
        if code is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = code

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def input_for(self, adapter: str | None) -> Callable | None:
        code = self.adapters.get(adapter) if adapter else None
        if code is not None and code.input_formatter is not None:
            return code.input_formatter
        return self.base.input_formatter if self.base is not None else None

    def output_for(self, adapter: str | None) -> Callable | None:
        code = self.adapters.get(adapter) if adapter else None
        if code is not None and code.output_formatter is not None:
            return code.output_formatter
        return self.base_output


def format_input(formatter: Callable, payload: dict, tokenizer: Any) -> dict:
    """The payload the built-in parser reads: `formatter(payload, tokenizer=tokenizer)` (LMI's vLLM form; the
    tokenizer only where the function takes it). Raises FormatterError (500) when it raises or returns no dict."""
    try:
        parameters = inspect.signature(formatter).parameters.values()
    except (TypeError, ValueError):
        parameters = ()
    takes_tokenizer = any(p.name == "tokenizer" or p.kind is p.VAR_KEYWORD for p in parameters)
    try:
        result = formatter(payload, tokenizer=tokenizer) if takes_tokenizer else formatter(payload)
    except Exception as exc:  # user code: any failure is this request's alone
        logger.warning("input formatter %s failed", _name(formatter), exc_info=exc)
        raise FormatterError.raised(formatter, "input", exc) from exc
    if not isinstance(result, dict):
        raise FormatterError(formatter, "input", f"it returned {type(result).__name__}, not a dict")
    return result
