"""A plain install (`pip install kiln-llm`, no test extras) can import every kiln module, and
every third-party package kiln imports is one it declares.

The import check runs in a subprocess whose ``sys.meta_path`` refuses the test-only packages,
so a module that (directly or through another kiln module) imports one of them fails here
instead of on a user's machine. The declaration check reads every ``import`` in kiln's source
(module level and inside functions) and maps it to its distribution.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kiln"
# [project.optional-dependencies] test, plus what pytest itself brings in.
TEST_ONLY = ("pytest", "_pytest", "openai", "schemathesis", "hypothesis")
# Packages of optional extras (CUDA-only backends such as flash-attn), import name -> extra:
# kiln may import them only inside the functions that use them.
OPTIONAL_LAZY: dict[str, str] = {"flash_attn": "flash-attn"}

_IMPORT_ALL = r"""
import importlib, json, pkgutil, sys

BLOCKED = set(sys.argv[1].split(","))

class _TestOnly:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is a test-only package, not installed by a plain install")
        return None

sys.meta_path.insert(0, _TestOnly())
import kiln

failed = {}
for info in pkgutil.walk_packages(kiln.__path__, "kiln."):
    if info.name.rsplit(".", 1)[-1] == "__main__":  # runs the CLI
        continue
    try:
        importlib.import_module(info.name)
    except BaseException as e:
        failed[info.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"failed": failed,
                  "test_only_loaded": sorted(m for m in sys.modules
                                             if m.split(".")[0] in BLOCKED)}))
"""


def import_every_module(blocked: tuple[str, ...] = TEST_ONLY) -> dict:
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, ",".join(blocked)],
                          capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_module_imports_without_the_test_packages():
    result = import_every_module()
    assert result["failed"] == {}, result["failed"]
    assert result["test_only_loaded"] == []


def test_the_import_check_catches_a_missing_package():
    """The same check with a runtime dependency blocked reports the modules that need it:
    the check can fail. (httpx is imported inside the function that uses it, so only the
    declaration check below sees it.)"""
    failed = import_every_module((*TEST_ONLY, "fastapi"))["failed"]
    assert "kiln.server.app" in failed and "fastapi" in failed["kiln.server.app"]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _normalize(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0])


def declared_dependencies(pyproject: Path = REPO / "pyproject.toml") -> set[str]:
    """Normalized distribution names of [project] dependencies (markers and versions off)."""
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # 3.10: what the install recorded from pyproject.toml
        deps = [r for r in requires("kiln-llm") or [] if "extra ==" not in r]
    else:
        deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {_name(d) for d in deps}


def third_party_imports(package: Path = PACKAGE) -> dict[str, dict[str, bool]]:
    """Top-level names of every absolute non-stdlib, non-kiln import -> {file: imported at
    module level (not only inside functions)}."""
    found: dict[str, dict[str, bool]] = {}

    def visit(node: ast.AST, path: Path, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                top = name.split(".")[0]
                if top != "kiln" and top not in sys.stdlib_module_names:
                    where = found.setdefault(top, {})
                    key = str(path.relative_to(package.parent))
                    where[key] = where.get(key, False) or not in_function
            visit(child, path, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for path in sorted(package.rglob("*.py")):
        visit(ast.parse(path.read_text(), str(path)), path, False)
    return found


def optional_extras(pyproject: Path = REPO / "pyproject.toml") -> set[str]:
    try:
        import tomllib
    except ModuleNotFoundError:
        return set()
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    return set(extras) - {"test"}


def undeclared(declared: set[str]) -> dict[str, str]:
    """Imports whose distribution is not declared: import name -> why."""
    dists = packages_distributions()
    problems = {}
    for name, files in sorted(third_party_imports().items()):
        candidates = {_normalize(d) for d in dists.get(name, [])}
        if name in OPTIONAL_LAZY:
            eager = sorted(f for f, module_level in files.items() if module_level)
            if eager or OPTIONAL_LAZY[name] not in optional_extras():
                problems[name] = (f"an optional extra's package must be imported inside the "
                                  f"functions that use it (module level in {eager}) and its "
                                  f"extra {OPTIONAL_LAZY[name]!r} declared in pyproject.toml")
        elif not candidates:
            problems[name] = f"not installed here (imported by {sorted(files)})"
        elif candidates & declared:
            continue
        else:
            problems[name] = (f"distribution {sorted(candidates)} is not in pyproject.toml "
                              f"[project] dependencies (imported by {sorted(files)})")
    return problems


def test_every_third_party_import_is_a_declared_dependency():
    assert undeclared(declared_dependencies()) == {}


def test_the_declaration_check_catches_an_undeclared_import():
    declared = declared_dependencies()
    assert "httpx" in declared and "typer" in declared
    problems = undeclared(declared - {"httpx"})
    assert set(problems) == {"httpx"}, problems
    assert "kiln/bench/online.py" in problems["httpx"]
    # httpx is imported inside the functions that use it, fastapi at module level:
    imports = third_party_imports()
    assert imports["httpx"] == {"kiln/bench/online.py": False}
    assert imports["fastapi"]["kiln/server/app.py"] is True
