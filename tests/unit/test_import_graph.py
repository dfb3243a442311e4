"""kiln's import graph has no circles (DESIGN principle 19: a lower layer never imports a
higher one).

The graph is read from the source with ``ast``, not from ``sys.modules``: every import of a
kiln module counts, at module level and inside functions alike, so a function-local import
cannot hide a circle. Only imports under ``if TYPE_CHECKING:`` are left out (they never run).

One node per file; a package's ``__init__.py`` is the package's node. ``from kiln.a import b``
is an edge to ``kiln.a.b`` when that is a module, else to ``kiln.a`` (its ``__init__`` when
``kiln.a`` is a package, which imports whatever it re-exports: a real dependency). The parent
packages Python initializes on the way to a module are not edges: Python runs a package's
``__init__`` before its submodules, so they never make a circle of their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kiln"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except the bodies of
    ``if TYPE_CHECKING:`` (their ``else`` branches run, so they count)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve_base(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (``from ..x import y`` in kiln.a.b -> kiln.x)."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    if node.level - 1 > len(package):
        raise ValueError(f"{name}: relative import beyond the top-level package")
    base = package[:len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _target(dotted: str, modules: set[str]) -> str | None:
    """The kiln module a dotted name lands in: the longest prefix that is a module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """Module -> the kiln modules it imports, and module -> its file."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [_target(alias.name, modules) for alias in node.names
                           if alias.name.split(".")[0] == top]
            else:
                base = _resolve_base(node, name, is_package)
                if base.split(".")[0] != top:
                    continue
                targets = []
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else _target(base, modules))
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph, files


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]], files: dict[str, Path]) -> str:
    rel = {m: str(files[m].relative_to(REPO)) for m in component}
    lines = [f"circle of {len(component)} files: " + ", ".join(rel[m] for m in component)]
    members = set(component)
    for m in component:
        for t in sorted(graph[m] & members):
            lines.append(f"  {rel[m]} -> {rel[t]}")
    return "\n".join(lines)


def test_kiln_has_no_import_circles():
    graph, files = import_graph()
    found = cycles(graph)
    assert not found, "import circles in kiln/:\n" + "\n".join(
        describe(c, graph, files) for c in found)


def test_the_graph_reads_every_kind_of_import(tmp_path):
    """The reader sees relative, absolute, ``import a.b``, submodule-as-name and
    function-local imports, skips ``if TYPE_CHECKING:``, and the check finds the circles."""
    pkg = tmp_path / "kiln"
    (pkg / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "sub/__init__.py": "from .leaf import thing\n",
        "sub/leaf.py": "thing = 1\n",
        # a package re-export is an edge to the __init__; a submodule name is an edge to it
        "a.py": "from kiln.sub import thing\nfrom kiln.sub import leaf\n",
        # function-local import, relative: b -> c
        "b.py": "def f():\n    from . import c\n    return c\n",
        # `import a.b` form: c -> b (circle b <-> c)
        "c.py": "import kiln.b\n",
        # TYPE_CHECKING is skipped, its else branch is not
        "d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln import a\n"
                 "else:\n    from kiln.sub.leaf import thing\n"),
        "sub/deep.py": "from ..a import x\nfrom .. import d\n",
    }
    for rel, text in sources.items():
        (pkg / rel).write_text(text)
    graph, _ = import_graph(pkg)
    assert graph["kiln.a"] == {"kiln.sub", "kiln.sub.leaf"}
    assert graph["kiln.sub"] == {"kiln.sub.leaf"}
    assert graph["kiln.b"] == {"kiln.c"}
    assert graph["kiln.c"] == {"kiln.b"}
    assert graph["kiln.d"] == {"kiln.sub.leaf"}
    assert graph["kiln.sub.deep"] == {"kiln.a", "kiln.d"}
    assert cycles(graph) == [["kiln.b", "kiln.c"]]


def test_kernels_are_leaves():
    """The kernels take tensors, never state objects: nothing under kiln/runtime/kernels
    imports kiln.runtime.speculative (or any module of it), at module level or in a
    function."""
    graph, files = import_graph()
    up = [f"{files[m].relative_to(REPO)} -> {t}" for m in sorted(graph)
          if m.startswith("kiln.runtime.kernels") for t in sorted(graph[m])
          if t == "kiln.runtime.speculative" or t.startswith("kiln.runtime.speculative.")]
    assert not up, "kernels import speculative state:\n" + "\n".join(up)
