"""The package's imports run one way: no two modules of ``bili_addon`` import each other, directly
or through others (wire -> kernel -> shell, the store beside).  Imports made only for type
checkers (under ``if TYPE_CHECKING:``) are not imports at run time and do not count; imports
inside functions do (a deferred import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, Path]:
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """The import statements of a module that run (not those under ``if TYPE_CHECKING:``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _type_checking(node):
            children = node.orelse  # (only the else branch runs)
        stack.extend(children)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports at run time."""
    mods = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:  # relative: from the module's package upwards
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name`` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # ``import a.b.c`` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected, more than one), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        # iterative Tarjan: (node, its neighbours still to visit)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def test_no_module_of_the_package_imports_one_that_imports_it():
    graph = import_graph(ROOT, "bili_addon")
    assert len(graph) > 40 and graph["bili_addon.kernel.turn"], "the package's modules were not read"
    assert cycles(graph) == [], "modules that import each other (make the lower one not know the upper)"


def test_the_check_finds_a_cycle_and_ignores_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")  # (deferred: still an import)
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "e.py").write_text("from pkg.d import x\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.d"}
    (pkg / "c.py").write_text("from pkg import d\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []
