"""Rules over the whole repository rather than one module: it stands alone (what the tests and the benchmark
read is inside it, and the copies still match their originals), packages point one way, and tests/ is laid
out as docs/architecture.md's "Tests" says, and the documents read as a manual."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
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
    """No two modules of lmi_handler import each other, directly or round a longer circle, when they are
    imported (the strongly connected components of the import graph). An import runs at import time unless
    it is inside a function: a function's import is excluded, as it is the way to break a circle on purpose
    (the late import runs when the function is called, after both modules are loaded). `from P import x`
    imports the module P.x when there is one, else P; a package's __init__ counts as the package."""
    modules = _modules()
    edges = {name: _imported_at_import_time(name, tree, modules) for name, tree in modules.items()}
    circles = _strongly_connected(edges)
    assert circles == [], "modules import each other at import time: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_import_circle_check_follows_submodule_imports_and_skips_functions():
    """The check above sees a circle closed by `from package import submodule` and by a relative import,
    and does not count an import inside a function."""
    source = {"lmi_handler.a": "from lmi_handler import b\n",
              "lmi_handler.b": "import lmi_handler.c as c\n",
              "lmi_handler.c": "from lmi_handler.a import x\n",
              "lmi_handler.d": "def late():\n    from lmi_handler import a\n",
              "lmi_handler.e": "from . import d\n",
              "lmi_handler.f": "class F:\n    from lmi_handler.e import y\n"}
    modules = {name: ast.parse(text) for name, text in source.items()}
    edges = {name: _imported_at_import_time(name, tree, modules) for name, tree in modules.items()}
    assert edges["lmi_handler.d"] == set() and edges["lmi_handler.e"] == {"lmi_handler.d"}
    assert edges["lmi_handler.f"] == {"lmi_handler.e"}
    assert _strongly_connected(edges) == [["lmi_handler.a", "lmi_handler.b", "lmi_handler.c"]]
    edges["lmi_handler.d"].add("lmi_handler.f")
    edges["lmi_handler.e"].add("lmi_handler.f")
    assert _strongly_connected(edges) == [["lmi_handler.a", "lmi_handler.b", "lmi_handler.c"],
                                          ["lmi_handler.d", "lmi_handler.e", "lmi_handler.f"]]


def _imported_at_import_time(name: str, tree: ast.Module, modules: dict) -> set[str]:
    """The modules of `modules` that module `name` imports when it is imported: every import statement outside a
    function body (module level, under an if or try, in a class body), relative ones resolved."""
    # where a relative import starts: a package's __init__ from the package itself, another module from its parent
    package = name if any(m.startswith(name + ".") for m in modules) else name.rpartition(".")[0]
    found = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        pending.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node of the directed graph `edges` (Tarjan's
    algorithm, iterative), each sorted, in sorted order: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


# getattr/hasattr with a literal name reads a field by guessing it is there; on our own objects write `.name`
# (or give the owner a method). The calls left are on third-party objects whose attributes vary by version.
THIRD_PARTY_GETATTR = {("engine/detokenizer.py", "added_tokens_decoder"),   # transformers tokenizers
                       ("prepare.py", "quantization_config"),               # transformers' GGUF config
                       ("engine/health.py", "AcceleratorError")}            # torch >= 2.8 only


MAX_MODULE_LINES = 500   # a module reads top to bottom in one sitting (STYLE.md); issue 46's limits
MAX_HEADER_LINES = 600


def test_no_module_of_the_package_runs_past_500_lines_nor_a_kernel_header_past_600():
    long = [f"{path.relative_to(REPO)} ({n})" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    long += [f"{path.relative_to(REPO)} ({n})" for path in sorted(PACKAGE.rglob("*.h"))
             if (n := len(path.read_text().splitlines())) > MAX_HEADER_LINES]
    assert long == [], f"split by what they hold: {long}"


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
# and their tests (named by case family), tests/benchmarks/ the harness's (named after benchmarks/ scripts),
# tests/evaluation/ lm-evaluation-harness's runs against the server and the tasks they read (named after the tool)
NOT_MIRRORED = {"cases", "benchmarks", "evaluation"}


def _test_files() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def test_test_files_are_named_after_the_modules_they_test():
    strays = []
    for path in _test_files():
        rel = path.relative_to(TESTS)
        top = rel.parts[0] if len(rel.parts) > 1 else ""
        name = rel.stem.removeprefix("test_")
        if rel.name == "test_repository.py" or top in ("cases", "evaluation"):
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


# ---- a new dialect touches the files docs/architecture.md names; TGI proves it -------------------

TGI_SYMBOLS = re.compile(r"Kind\.TGI_|Dialect\.TGI|Shape\.TGI|TgiDocument|TgiStream|_tgi_error|ROUTE_GENERATE|ROUTE_TGI")


def _dialect_files_in_architecture() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Adding an output dialect"):]
    section = section[:section.index("\n## ")]
    bullets = [line for line in section.splitlines() if line.startswith("- `")]
    return [re.match(r"- `([^`]+)`", line).group(1).replace("<dialect>", "tgi") for line in bullets]


def test_the_architecture_page_names_every_file_a_dialect_needs_and_tgi_touches_no_other():
    named = _dialect_files_in_architecture()
    assert named == ["protocol/dialects.py", "protocol/plan.py", "protocol/formatters/tgi.py",
                     "protocol/formatters/answers.py", "protocol/errors.py", "protocol/invocations.py", "server/tgi.py"]
    touching = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if TGI_SYMBOLS.search(p.read_text()))
    assert touching == sorted(named)


def test_every_dialect_has_its_error_shape_and_every_shape_its_formatters():
    from lmi_handler.protocol import errors
    from lmi_handler.protocol.dialects import Dialect
    from lmi_handler.protocol.formatters import answers
    from lmi_handler.protocol.plan import Kind, RequestPlan, Shape

    assert set(errors._ERROR_SHAPES) == set(Dialect)
    assert set(answers._DOCUMENTS) == set(answers._STREAMS) == set(Shape)
    assert set(answers._FAILURES) == set(Dialect)
    dialects = {RequestPlan("r", kind, Shape.LMI, None, False, ()).dialect for kind in Kind}
    assert dialects == set(Dialect)
    for dialect in Dialect:            # each shape names the message and its status the way its clients read
        body = errors.error_body(dialect, "boom", 400, "field")
        assert "boom" in json.dumps(body) and isinstance(body["error"], (str, dict))


# ---- the benchmark narrative is not README's (benchmarks/results: tests/benchmarks/test_bench_tool.py) ---------

def test_the_readme_cites_no_benchmark_run_and_links_the_performance_page():
    readme = (REPO / "README.md").read_text()
    assert "results/" not in readme and "tok/s" not in readme
    assert "(docs/performance.md)" in readme


def test_the_protocol_layer_never_imports_torch():
    """STYLE: protocol/ parses and formats without torch (a spec is checked by engine/grammar_spec.py)."""
    code = ("import importlib, pkgutil, sys, lmi_handler.protocol as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'lmi_handler.protocol.{m.name}')\n"
            "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout[-500:]


# ---- the documents are a manual: a short README, topic pages, no dated run logs ----------------------

DOCS = REPO / "docs"
# dates as a run log writes them: 2026-12-04, 2026/12/04, 04/12/2026, Dec 4, 2026, 4 December 2026, December 2026
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(rf"\b\d{{4}}-\d{{1,2}}-\d{{1,2}}\b|\b\d{{4}}/\d{{1,2}}/\d{{1,2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{4}}\b"
                  rf"|\b{MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b|\b\d{{1,2}} {MONTH} \d{{4}}\b|\b{MONTH} \d{{4}}\b")
# the one page whose current table carries its run's date (issue 37: "one current table ... with its date")
DATED_PAGES = {"docs/performance.md"}
PERFORMANCE = DOCS / "performance.md"     # written with the benchmark (benchmarks/); linked before it lands


def test_the_readme_is_a_short_manual_that_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 450, f"README.md has {len(lines)} lines; move detail into a docs/ page"
    assert lines[:3] == ["# lmi_handler", "", "```bash"]
    assert lines[3].startswith("make serve ") and lines[4].startswith("make test ") and lines[5] == "```"


def test_the_readme_links_every_docs_page_and_every_link_to_a_page_resolves():
    readme = (REPO / "README.md").read_text()
    pages = sorted(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md"))
    assert [p for p in pages if f"]({p}" not in readme] == []
    broken = []
    for document in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)", document.read_text()):
            if not (document.parent / target).is_file() and (document.parent / target).resolve() != PERFORMANCE:
                broken.append(f"{document.relative_to(REPO)} -> {target}")
    assert broken == []


def test_no_document_but_the_performance_table_holds_a_date():
    """A run's details live in its results JSON, a change's reasons in its commit message (issue 37)."""
    documents = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    dated = [f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
             for path in documents if path.relative_to(REPO).as_posix() not in DATED_PAGES
             for number, line in enumerate(path.read_text().splitlines(), 1) for match in DATE.finditer(line)]
    assert dated == [], "dated run logs belong in git history and results JSON:\n" + "\n".join(dated)


def test_the_date_search_finds_the_ways_a_run_log_writes_a_date():
    found = [m.group(0) for m in DATE.finditer("on 2026-12-04, 2026/12/04, 04/12/2026, Dec 4, 2026, 4 December 2026, "
                                               "December 2026; not 2048-token prompts, 1e-5, 64 x 128 or 0.9.1")]
    assert found == ["2026-12-04", "2026/12/04", "04/12/2026", "Dec 4, 2026", "4 December 2026", "December 2026"]


def _readme_examples() -> list[tuple[str, str]]:
    return re.findall(r"```(bash|python|properties)\n(.*?)```", (REPO / "README.md").read_text(), re.S)


@pytest.mark.slow
def test_the_readmes_examples_work_as_printed(rolling_server, dynamic_server, batch_server, tmp_path):
    """Every way in, run in a directory laid out like a checkout; only the servers' ports and the interpreter
    differ. Not run here: `make serve` itself, the properties block and the Ray command (a cluster:
    tests/batch/test_cluster.py)."""
    shutil.copy(REPO / "serving.properties", tmp_path / "serving.properties")
    (tmp_path / "model").symlink_to(REPO / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTION_")}
    env.update(PYTHONPATH=str(REPO), OPTION_NUM_THREADS="1")
    examples = _readme_examples()
    assert [lang for lang, _ in examples] == ["bash", "bash", "bash", "python", "bash", "python", "bash", "python",
                                              "bash", "properties", "python"]
    ran = []
    for lang, code in examples[1:]:
        if lang == "properties" or "--ray" in code:
            continue
        if lang == "bash" and shutil.which("curl") is None and "curl " in code:
            pytest.skip("curl is not installed on this host")
        code = "\n".join(line for line in code.splitlines() if not line.startswith("OPTION_ROLLING_BATCH=disable"))
        url = batch_server.url if "batches.create" in code else rolling_server.url
        code = code.replace("http://localhost:8080", url).replace("localhost:8080", url)
        code = code.replace("localhost:8081", dynamic_server.url)
        command = (["bash", "-ec", code.replace(".venv/bin/lmi-handler", f"{sys.executable} -m lmi_handler.cli")]
                   if lang == "bash" else [sys.executable, "-c", code])
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
        ran.append(done.stdout)
    invocations, dynamic, openai_sdk, tgi, hf, _batch, batch_api, in_process = ran
    assert invocations.count('"generated_text"') == 2 and '"chat.completion"' in invocations   # whole, streamed, chat
    assert [type(a["generated_text"]) for a in json.loads(dynamic)] == [str, str]
    person, _ = json.JSONDecoder().raw_decode(openai_sdk[openai_sdk.rfind("\n{") + 1:])   # its last print
    assert set(person) == {"name", "age"}
    assert tgi.count("data:") >= 2 and hf.strip()
    assert {r["custom_id"] for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())} \
        == {"colors", "sea"}
    assert "completed" in batch_api and "'generated_text'" in in_process
