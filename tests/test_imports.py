"""Repository hygiene: no import cycles inside ``ragen_jax`` and ``experiments``, no ``sys.path``
edits in ``experiments``, every result file linked from the documentation, no links to files a
clone lacks.

The import graph is read from the source with ``ast``, not by importing: every ``import`` and
``from ... import`` counts, at module level or inside a function (an import deferred into a
function hides a cycle at import time but the two modules still depend on each other). Only
imports under ``if TYPE_CHECKING:`` are skipped, since they never run.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import ragen_jax

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# The import graph
# ----------------------------------------------------------------------------------------------


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the ``ragen_jax`` package: name -> (source file, is a package)."""
    def unimportable(name):  # walk_packages imports subpackages; it would skip a broken one
        raise ImportError(f"cannot import the subpackage {name}")

    modules = {"ragen_jax": (Path(ragen_jax.__file__), True)}
    for info in pkgutil.walk_packages(ragen_jax.__path__, "ragen_jax.", onerror=unimportable):
        spec = info.module_finder.find_spec(info.name, None)
        if spec is None or spec.origin is None:  # pragma: no cover - unusual finders
            spec = importlib.util.find_spec(info.name)
        modules[info.name] = (Path(spec.origin), info.ispkg)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """All import statements, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, known: set[str]) -> str | None:
    """``name`` or its longest prefix that is a module of the package (None if none is)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def module_imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (whose code is ``source``) imports.

    ``import a.b.c`` depends on ``a.b.c``; ``from a.b import c`` on ``a.b.c`` when that is a
    module, else on ``a.b`` (``c`` is a name defined there). Relative imports are resolved
    against the module's package (the module itself for a package's ``__init__``).
    """
    package = name if is_package else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 >= len(base_parts):
                    raise ValueError(f"{name}: relative import beyond the top-level package")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names if alias.name != "*"] or [base]
        for target in targets:
            dep = _known(target, known)
            if dep is not None:
                deps.add(dep)
    return deps


def source_modules(folder: str) -> dict[str, tuple[Path, bool]]:
    """Every module of the package in ``REPO / folder``, read from its files (not imported:
    the experiments import optional packages): name -> (source file, is a package)."""
    modules = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(with_experiments: bool = False) -> dict[str, set[str]]:
    """``ragen_jax`` module -> the ``ragen_jax`` modules it imports; with ``with_experiments``
    the ``experiments`` modules too, each with the modules of both that it imports."""
    modules = package_modules()
    if with_experiments:
        modules |= source_modules("experiments")
    known = set(modules)
    return {name: module_imports(name, path.read_text(encoding="utf-8"), is_pkg, known)
            for name, (path, is_pkg) in sorted(modules.items())}


# ----------------------------------------------------------------------------------------------
# Cycles
# ----------------------------------------------------------------------------------------------


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one, as a closed path
    ``[a, b, ..., a]`` (a shortest cycle through the component's smallest node).

    Nodes that only appear as targets count as nodes without edges. Deterministic: sorted.
    """
    edges = {n: sorted(set(ts)) for n, ts in graph.items()}
    for ts in list(edges.values()):
        for t in ts:
            edges.setdefault(t, [])

    # Tarjan's strongly connected components, iteratively (no recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))

    cycles = []
    for component in components:
        start = component[0]
        if len(component) == 1 and start not in edges[start]:
            continue
        members = set(component)
        # Breadth-first search from start back to start inside the component.
        previous: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            following = []
            for node in frontier:
                for child in edges[node]:
                    if child not in members:
                        continue
                    if child == start:
                        found = node
                        break
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
                if found is not None:
                    break
            frontier = following
        path = [start]
        node = found
        while node != start:
            path.append(node)
            node = previous[node]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def test_find_cycles_on_hand_made_graphs():
    # A diamond and a tail: no cycle.
    dag = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set(), "e": {"a"}}
    assert find_cycles(dag) == []
    assert find_cycles({}) == []
    # One cycle a -> b -> c -> a, reached from outside and with an exit.
    assert find_cycles({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a", "d"}}) == [
        ["a", "b", "c", "a"]]
    # A self-loop, and two separate cycles (one given in a different edge order).
    assert find_cycles({"a": {"a"}, "b": set()}) == [["a", "a"]]
    assert find_cycles({"p": ["q"], "q": ["p"], "x": ["z"], "z": ["y"], "y": ["x"]}) == [
        ["p", "q", "p"], ["x", "z", "y", "x"]]
    # A component with several cycles: a shortest one through its smallest node.
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": {"a"}}) == [
        ["a", "c", "d", "a"]]
    # Adding one back edge to the DAG closes a cycle.
    assert find_cycles({**dag, "d": {"e"}}) == [["a", "b", "d", "e", "a"]]


def test_module_imports_resolution():
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"}
    source = """
import os
import pkg.a
from pkg import b, CONSTANT
from . import d
from .. import a as _a
from ..sub import c
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from pkg.b import Unused  # never runs: not a dependency

def later():
    from pkg.sub.c import f  # function-level imports count
    import pkg.sub.d as dd
"""
    assert module_imports("pkg.sub.e", source, False, known) == {
        "pkg", "pkg.a", "pkg.b", "pkg.sub.d", "pkg.sub.c"}
    # In a package's __init__, "." is the package itself.
    assert module_imports("pkg.sub", "from . import c\nfrom .d import x\n", True, known) == {
        "pkg.sub.c", "pkg.sub.d"}
    assert module_imports("pkg.a", "from pkg.sub import NAME\n", False, known) == {"pkg.sub"}
    with pytest.raises(ValueError, match="beyond"):
        module_imports("pkg.a", "from ... import x\n", False, known)


def test_no_import_cycles_in_ragen_jax_or_experiments():
    graph = import_graph(with_experiments=True)
    assert "ragen_jax.models.qwen" in graph and "ragen_jax.starpo.losses" in graph
    assert "experiments.common" in graph and "experiments.benchmarks.bench_decode" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles)


def defined_names(tree: ast.Module) -> set[str]:
    """The names a module defines at top level (functions, classes, assignments), not those it
    imports."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def reexported_imports(modules: Mapping[str, tuple[Path, bool]], files: Iterable[Path]
                       ) -> list[str]:
    """``from M import name`` lines, in ``files``, whose ``name`` M only imports from elsewhere:
    a name is imported from the module that defines it. A package's ``__init__`` is exempt (its
    names are the package's public surface), as are submodules (``from pkg import module``)."""
    defined = {}
    found = []
    for path in files:
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in modules:
                continue
            source, is_package = modules[node.module]
            if is_package:
                continue
            if node.module not in defined:
                defined[node.module] = defined_names(ast.parse(source.read_text(encoding="utf-8")))
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {a.name} from {node.module}"
                      for a in node.names
                      if a.name not in defined[node.module] and f"{node.module}.{a.name}" not in modules]
    return found


def test_reexported_imports_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    files = {"a.py": "import os\nX = 1\ndef f(): pass\n", "b.py": "from a import X, f\n",
             "c.py": "from a import X\nfrom b import f\nfrom pkg import a\n", "pkg/__init__.py": "from a import X\n",
             "d.py": "from pkg import X\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {"a": (tmp_path / "a.py", False), "b": (tmp_path / "b.py", False),
               "pkg": (tmp_path / "pkg/__init__.py", True), "pkg.a": (tmp_path / "a.py", False)}
    assert defined_names(ast.parse(files["a.py"])) == {"X", "f"}
    found = reexported_imports(modules, [tmp_path / n for n in files])
    assert found == ["c.py:2: f from b"]


def test_names_are_imported_from_the_module_that_defines_them():
    """No module re-exports another's names (a shim that hides where a name lives)."""
    modules = package_modules() | source_modules("experiments")
    files = [path for folder in ("ragen_jax", "experiments", "tests", "configs")
             for path in sorted((REPO / folder).rglob("*.py"))] + [REPO / "launch.py"]
    found = reexported_imports(modules, files)
    assert len(files) > 100
    assert not found, "names imported through a module that does not define them:\n" + \
        "\n".join("  " + line for line in found)


def test_experiments_do_not_edit_sys_path():
    """The scripts run as modules from the repository root (``python -m experiments...``) and
    import each other as a package; a ``sys.path`` edit would hide a broken import."""
    offenders = []
    for path in sorted((REPO / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                offenders.append(f"  {path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, "sys.path used in experiments:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------------------------
# Every result file is linked
# ----------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")  # a markdown link's target, anchor dropped


def linked_results() -> set[Path]:
    """The files under ``experiments/results`` reached by markdown links from ``docs/`` and the
    README, following links through the result pages they reach."""
    results = REPO / "experiments" / "results"
    todo = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
    seen, reached = set(), set()
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            if "://" not in target and path.is_relative_to(results) and path.is_file():
                reached.add(path)
                if path.suffix == ".md":
                    todo.append(path)
    return reached


def test_every_result_file_is_linked_from_the_docs():
    """A result nobody links is a result nobody reads: link it where it belongs (the index is
    ``docs/results.md``) or delete it (git keeps it)."""
    results = REPO / "experiments" / "results"
    # run folders (runs/, runs_<tag>/), logs and temporaries are git-ignored: the files only
    files = {p.resolve() for p in results.iterdir() if p.is_file() and p.suffix not in (".log", ".tmp")}
    unlinked = sorted(str(p.relative_to(REPO)) for p in files - linked_results())
    assert not unlinked, "result files no page links:\n" + "\n".join(f"  {u}" for u in unlinked)


# ----------------------------------------------------------------------------------------------
# No references to files outside the repository
# ----------------------------------------------------------------------------------------------

# Built from pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "DES" + "IGN.md", "RAGEN" + "_FACTS")


def test_no_references_to_files_a_clone_lacks():
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", "*.py", "*.md", "*.cfg", "*.toml"],
            cwd=REPO, capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    offenders = []
    for rel in sorted(filter(None, listed.split("\0"))):
        path = REPO / rel
        if not path.is_file():  # deleted in the working tree
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits = [word for word in FORBIDDEN if word in line]
            if hits:
                offenders.append(f"  {rel}:{lineno}: {', '.join(hits)}")
    assert not offenders, "references to files outside the repository:\n" + "\n".join(offenders)
