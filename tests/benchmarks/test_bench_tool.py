"""benchmarks/ as one tool: few tools (ab.py's and profiling.py's commands in their folders), no import circle;
benchmarks/results keeps what a document cites and nothing else; docs/performance.md's tables are the rendering of
the runs they cite."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import report  # noqa: E402

CITING = [REPO / "README.md", BENCH / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CITED = re.compile(r"results/([A-Za-z0-9_.-]+\.(?:json|png))")


def _imports(path: Path, siblings: set[str]) -> set[str]:
    """The sibling modules `path` imports anywhere in it (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & siblings - {path.stem}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as a path that ends where it starts, else None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*trail[trail.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt, [*trail, nxt])):
                return found
        state[node] = 2
        return None

    return next((c for start in sorted(graph) if start not in state and (c := visit(start, [start]))), None)


COMMAND_FOLDERS = ("ab_commands", "profiling_commands")     # one module per command of ab.py and profiling.py


def test_benchmarks_has_fewer_than_20_tools_each_commands_in_its_folder_and_no_import_circle():
    # git's list, not a walk: `make bench-setup` puts the peers' virtualenvs (thousands of .py files) in benchmarks/
    listed = subprocess.run(["git", "ls-files", "benchmarks"], cwd=REPO, capture_output=True, text=True, check=True)
    files = sorted(REPO / name for name in listed.stdout.split() if name.endswith(".py"))
    tools = [f for f in files if f.parent == BENCH]
    assert len(tools) < 20, [str(f.relative_to(BENCH)) for f in tools]
    assert {f.parent.name for f in files if f.parent != BENCH} == set(COMMAND_FOLDERS)   # no other folder of code
    for folder in COMMAND_FOLDERS:           # each command folder's tool dispatches to every module in it
        tool = (BENCH / f"{folder.removesuffix('_commands')}.py").read_text()
        assert all(p.stem in tool for p in (BENCH / folder).glob("*.py") if p.stem != "revision")
    # a command folder is one node: the tools import it, it imports the tools' shared modules
    modules = {p.stem: [p] for p in BENCH.glob("*.py")} | {f: sorted((BENCH / f).glob("*.py")) for f in COMMAND_FOLDERS}
    graph = {name: set().union(*(_imports(p, set(modules)) for p in paths)) - {name} for name, paths in modules.items()}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]    # the check finds one


def _committed_results() -> list[str]:
    """The files git tracks in benchmarks/results (a local run's files are not the repository's)."""
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=REPO, capture_output=True, text=True,
                            check=True)
    return [Path(p).name for p in listed.stdout.split()]


def test_every_results_file_is_cited_by_a_document_and_every_cited_one_is_there():
    kept = set(_committed_results())
    cited = {name for doc in CITING if doc.is_file() for name in CITED.findall(doc.read_text())}
    assert cited - kept == set(), "cited but missing from benchmarks/results"
    assert kept - cited == set(), "kept in benchmarks/results but cited by no document"
    assert len(kept) <= 12
    assert {Path(n).stem for n in kept if n.endswith(".json")} == {Path(n).stem for n in kept if n.endswith(".png")}


def test_performance_tables_are_the_rendering_of_the_newest_committed_run_of_each_host_kind():
    doc = REPO / "docs" / "performance.md"
    text = doc.read_text()
    block = text[text.index(report.DOCS_START):text.index(report.DOCS_END) + len(report.DOCS_END)]
    committed = [BENCH / "results" / name for name in _committed_results()]
    runs = report.latest_per_host_kind(paths=committed)
    assert runs, "no committed bench run names its host kind"
    assert block == report.render_docs(runs, doc), "docs/performance.md is stale: python benchmarks/report.py --write-docs"
    assert all(f"results/{run.name}" in block and f"results/{run.stem}.png" in block for run in runs)
