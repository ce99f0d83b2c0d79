"""The layers the folders show, checked on the source: no import cycle, no import upwards.

    pipeline/core/      config, runtime, io, plots: used by every package, imports none of them
    models/  shards/    pure torch numerics / everything on disk: on the core only
    stages/             one module per stage + stages/configs/: on models and shards
    pipeline/ (the app) cli, chain, demo, study, the stage registry: on everything below
    bench/              benchmarks: may use anything

Every import counts, module-level or inside a function (a lazy import is still a dependency);
only `if TYPE_CHECKING:` blocks are left out. Stages are found by name through the registry
(importlib), which is how the app reaches them without a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "stages", "models", "shards", "bench")
LAYERS = {"pipeline.core": 0, "models": 1, "shards": 1, "stages": 2, "pipeline": 3, "bench": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str], name: str = "") -> set[str]:
    """The project modules `path` (module `name`) imports (`from pkg import mod` counts mod)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path a -> ... -> a, or [] (iterative DFS, three colours)."""
    colour = dict.fromkeys(edges, 0)
    for start in sorted(edges):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return [*path[path.index(child) :], child]
            elif colour.get(child) == 0:
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges[child]))))
    return []


def test_the_walker_sees_a_cycle_and_lazy_imports(tmp_path):
    """The checker itself: a lazy import closing a loop is found; TYPE_CHECKING is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.hidden\n"
        "def f():\n    from x import lazy\n    import x.other as o\n"
    )
    mods = {"x.hidden", "x.lazy", "x.other", "x"}
    assert imports_of(src, mods, "t.m") == {"x", "x.lazy", "x.other"}


def test_no_import_cycle_in_the_project():
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in graph().items()
        for d in deps
        if layer(d) > layer(m)
    )
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", ["models", "shards", "stages", "pipeline"])
def test_no_module_over_400_lines(package):
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 420
    }
    assert not long, f"modules over ~400 lines: {long}"
