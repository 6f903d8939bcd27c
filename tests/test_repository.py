"""Rules over the whole repository rather than one module: it stands alone (what the tests and the benchmark
read is inside it, and the copies still match their originals), packages point one way, and tests/ is laid
out as README's "Tests and benchmarks" says."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from tests.helpers import CASES_DIR, MT_BENCH, REPO, SHARED

# repository copy -> where it comes from, under ../shared
COPIES = {CASES_DIR: SHARED / "cases", MT_BENCH.parent: SHARED / "data"}


def test_the_request_cases_and_the_benchmark_prompts_are_inside_the_repository():
    assert {p.name for p in CASES_DIR.glob("C*.json")} >= {"C01.json", "C09.json", "C31.json"}
    assert (CASES_DIR / "README.md").is_file()
    assert MT_BENCH.is_file() and len(MT_BENCH.read_text().splitlines()) == 80
    assert "Apache License" in (MT_BENCH.parent / "LICENSE").read_text()   # the MT-bench questions' licence
    assert "Apache License 2.0" in (MT_BENCH.parent / "README.md").read_text()


@pytest.mark.parametrize("copy", sorted(COPIES), ids=lambda p: str(p.relative_to(REPO)))
def test_the_copies_match_shared_when_it_is_beside_the_checkout(copy):
    original = COPIES[copy]
    if not original.is_dir():
        pytest.skip(f"{original} is not here (a clone alone): nothing to compare the copies with")
    for source in sorted(p for p in original.iterdir() if p.is_file()):
        mirrored = copy / source.name
        assert mirrored.is_file(), f"{source.name} of {original} has no copy in {copy}"
        assert mirrored.read_bytes() == source.read_bytes(), f"{mirrored} differs from {source}: copy it again"


# ---- packages point one way -----------------------------------------------------------------

PACKAGE = REPO / "lmi_handler"


def _modules() -> dict[str, ast.Module]:
    """Every module of lmi_handler by dotted name, parsed."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _imported(tree: ast.Module) -> set[str]:
    """The lmi_handler modules a module imports anywhere (module level or inside a function)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmi_handler"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("lmi_handler"))
    return names


def _unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: lmi_handler.server.app -> server."""
    return module.split(".")[1] if "." in module else module


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph `edges`, or None (depth-first search)."""
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_lmi_handlers_packages():
    """Packages point one way (STYLE): e.g. the batch jobs use the front end, the front end never the jobs.
    Every import counts, a function's lazy ones too."""
    edges: dict[str, set[str]] = {}
    for name, tree in _modules().items():
        edges.setdefault(_unit(name), set()).update(_unit(m) for m in _imported(tree) if _unit(m) != _unit(name))
    assert _cycle(edges) is None, f"packages import each other: {' -> '.join(_cycle(edges))}"
    assert "server" not in edges["batch"] | edges["frontend"] and "batch" not in edges["frontend"]


def test_no_import_cycle_between_modules_at_import_time():
    modules = _modules()
    edges = {name: {m for m in _imported_at_top(tree) if m in modules and m != name} for name, tree in modules.items()}
    assert _cycle(edges) is None, f"modules import each other: {' -> '.join(_cycle(edges))}"


def _imported_at_top(tree: ast.Module) -> set[str]:
    return {node.module for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmi_handler")}


# getattr/hasattr with a literal name reads a field by guessing it is there; on our own objects write `.name`
# (or give the owner a method). The calls left are on third-party objects whose attributes vary by version.
THIRD_PARTY_GETATTR = {("engine/detokenizer.py", "added_tokens_decoder"),   # transformers tokenizers
                       ("prepare.py", "quantization_config"),               # transformers' GGUF config
                       ("engine/health.py", "AcceleratorError")}            # torch >= 2.8 only


def test_no_getattr_on_another_modules_state_and_no_private_imports():
    guesses, private = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and (where, node.args[1].value) not in THIRD_PARTY_GETATTR):
                guesses.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmi_handler"):
                private += [f"{where}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert guesses == [] and private == []


def test_the_handler_state_has_one_accessor_and_the_app_keeps_its_own_on_app_state():
    """No module global the app (or a test) reaches and swaps: the container's Handler is handler.py's own,
    the bundled app builds one and keeps it (and its Service) on app.state."""
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert sum(text.count("get_state(") for text in sources.values()) <= 1
    assert [name for name, text in sources.items() if "_CONTAINER" in text] == ["handler.py"]
    app = sources["server/app.py"]
    assert "app.state.service" in app and "Handler(settings" in app
    assert sum(text.count("Settings.from_properties(") for name, text in sources.items()
               if name.startswith(("server/", "frontend/", "batch/server.py"))) == 1     # parsed once, in create_app


# ---- tests/ mirrors lmi_handler/ ------------------------------------------------------------

TESTS = REPO / "tests"
# tests/<dir>/ mirrors lmi_handler/<dir>/ (""": the top-level modules); tests/cases/ holds the request cases
# and their tests (named by case family), tests/benchmarks/ the harness's (named after benchmarks/ scripts)
NOT_MIRRORED = {"cases", "benchmarks"}


def _test_files() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def test_test_files_are_named_after_the_modules_they_test():
    strays = []
    for path in _test_files():
        rel = path.relative_to(TESTS)
        top = rel.parts[0] if len(rel.parts) > 1 else ""
        name = rel.stem.removeprefix("test_")
        if rel.name == "test_repository.py" or top == "cases":
            continue
        if top == "benchmarks":
            ok = any(name.startswith(p.stem) for p in (REPO / "benchmarks").glob("*.py"))
        else:
            base = PACKAGE / top
            modules = {p.stem for p in (base.rglob("*.py") if top else base.glob("*.py"))}
            ok = name in modules | {p.name for p in base.rglob("*") if p.is_dir()}
        if not ok:
            strays.append(str(rel))
    assert strays == [], "name each test file after the module it tests (tests/<pkg>/test_<module>.py)"


def test_conftest_modules_hold_fixtures_only_and_no_test_imports_another():
    """Helpers live in helpers.py modules; a test module never imports a test module or a conftest."""
    misplaced, imports = [], []
    for path in sorted(TESTS.rglob("*.py")):
        rel, tree = str(path.relative_to(TESTS)), ast.parse(path.read_text())
        if path.name == "conftest.py":
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("pytest_") \
                        and not any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", [])):
                    misplaced.append(f"{rel}: {node.name}")
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("tests.") and module.split(".")[-1].startswith(("test_", "conftest")):
                imports.append(f"{rel}: {module}")
    assert misplaced == [] and imports == []


def _either_or(test: ast.expr) -> bool:
    """`assert a or b`, or an HTTP status / batch status accepted from a list of several."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return True
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            options = node.comparators[0]
            if isinstance(options, (ast.Tuple, ast.List, ast.Set)) and len(options.elts) > 1 \
                    and "status" in ast.unparse(node.left):
                return True
    return False


def test_no_assertion_accepts_either_of_two_outcomes():
    """A test pins the one answer the code gives (a sampled outcome is stated as a set it must fall in)."""
    found = [f"{path.relative_to(TESTS)}:{node.lineno}" for path in _test_files()
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assert) and _either_or(node.test)]
    assert found == []


# ---- a new dialect touches the files README's Architecture names; TGI proves it -------------------

TGI_SYMBOLS = re.compile(r"Kind\.TGI_|Dialect\.TGI|Shape\.TGI|TgiDocument|TgiStream|_tgi_error|ROUTE_GENERATE|ROUTE_TGI")


def _dialect_files_in_readme() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Adding an output dialect"):]
    section = section[:section.index("\n## ")]
    bullets = [line for line in section.splitlines() if line.startswith("- `")]
    return [re.match(r"- `([^`]+)`", line).group(1).replace("<dialect>", "tgi") for line in bullets]


def test_readmes_architecture_names_every_file_a_dialect_needs_and_tgi_touches_no_other():
    named = _dialect_files_in_readme()
    assert named == ["protocol/dialects.py", "protocol/plan.py", "protocol/formatters.py", "protocol/errors.py",
                     "protocol/invocations.py", "server/tgi.py"]
    touching = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if TGI_SYMBOLS.search(p.read_text()))
    assert touching == sorted(named)


def test_every_dialect_has_its_error_shape_and_every_shape_its_formatters():
    from lmi_handler.protocol import errors, formatters
    from lmi_handler.protocol.dialects import Dialect
    from lmi_handler.protocol.plan import Kind, RequestPlan, Shape

    assert set(errors._ERROR_SHAPES) == set(Dialect)
    assert set(formatters._DOCUMENTS) == set(formatters._STREAMS) == set(Shape)
    dialects = {RequestPlan("r", kind, Shape.LMI, None, False, ()).dialect for kind in Kind}
    assert dialects == set(Dialect)
    for dialect in Dialect:            # each shape names the message and its status the way its clients read
        body = errors.error_body(dialect, "boom", 400, "field")
        assert "boom" in json.dumps(body) and isinstance(body["error"], (str, dict))


# ---- the benchmark narrative is not README's (benchmarks/results: tests/benchmarks/test_bench_tool.py) ---------

def test_the_benchmark_narrative_lives_in_benchmarks_readme_only():
    readme = (REPO / "README.md").read_text()
    assert "results/bench-" not in readme and "tok/s" not in readme
    assert "benchmarks/README.md" in readme


def test_the_protocol_layer_never_imports_torch():
    """STYLE: protocol/ parses and formats without torch (a spec is checked by engine/grammar_spec.py)."""
    code = ("import importlib, pkgutil, sys, lmi_handler.protocol as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'lmi_handler.protocol.{m.name}')\n"
            "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout[-500:]
