"""The package's shape, read from its source with `ast`: who may import whom, and how
long a module may grow. Imports under `TYPE_CHECKING` and inside functions count: an
import for typing alone still ties two modules together for a reader."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hostagent"
LONGEST = 800
# A module that grows past LONGEST is split by concern (as hostagent.cluster.kube is, and
# the machine: its rules for every phase, its live changes and what they share apart).
LONGER: dict[str, int] = {}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, however and wherever it does."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1],
                                 *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


@functools.cache
def read_graph() -> dict[str, set[str]]:
    """`graph()` in a fresh interpreter: once other tests ran, CPython 3.11's ast.parse
    may fail with "AST constructor recursion depth mismatch" (its count goes stale)."""
    code = ("import json, runpy, sys; graph = runpy.run_path(sys.argv[1])['graph']; "
            "print(json.dumps({k: sorted(v) for k, v in graph().items()}))")
    done = subprocess.run([sys.executable, "-c", code, __file__], capture_output=True,
                          text=True, check=True)
    return {k: set(v) for k, v in json.loads(done.stdout).items()}


def test_the_graph_is_read() -> None:
    edges = read_graph()
    assert "hostagent.service.main" in edges["hostagent.cli"]
    assert "hostagent.service.agent" in edges["hostagent.service.main"]
    assert "hostagent.core.machine" in edges["hostagent.service.agent"]


def test_no_import_circle() -> None:
    edges = read_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circle = path[path.index(name):] + [name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        for other in sorted(edges[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])


def test_only_the_cli_imports_the_agent() -> None:
    """Through `hostagent run`'s module, which builds an agent per lendee."""
    graph = read_graph()
    assert sorted(name for name, used in graph.items() if "hostagent.service.agent" in used) == [
        "hostagent.service.main"]
    assert sorted(name for name, used in graph.items() if "hostagent.service.main" in used) == [
        "hostagent.cli"]


def test_no_module_grows_past_its_length() -> None:
    long = {}
    for name, path in modules().items():
        lines = len(path.read_text().splitlines())
        if lines > LONGER.get(name, LONGEST):
            long[name] = lines
    assert not long, f"split these by concern (at most {LONGEST} lines each): {long}"


def test_the_architecture_names_each_module_in_its_layer() -> None:
    """docs/architecture.md's table of layers lists every module of each package, and
    only those: the tree as it is, for whoever reads it before the code."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = {}
    for line in doc.splitlines():
        if line.startswith("| `") and "/` |" in line:
            layer, names = line.split("|")[1:3]
            listed[layer.strip(" `/")] = set(names.replace("`", "").replace(" ", "").split(","))
    found: dict[str, set[str]] = {}
    for name in modules():
        parts = name.split(".")
        if len(parts) == 3:
            found.setdefault(parts[1], set()).add(parts[2])
    assert listed == found


def test_no_test_file_imports_another() -> None:
    """Helpers live in helper modules (tests/unit/agents.py, tests/lab/helpers.py,
    tests/mosquitto.py...): a test file imported by another runs its module-level setup
    twice and ties two files' fates together. Imports inside functions count."""
    tests = PACKAGE.parent / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(tests.parent)}:{node.lineno} imports {n}"
                      for n in names if n.startswith("tests.")
                      and n.rpartition(".")[2].startswith("test_")]
    assert not found, found
