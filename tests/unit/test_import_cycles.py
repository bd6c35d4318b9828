"""No module-level import cycle among the dsv4_* packages, ``TYPE_CHECKING`` imports included:
every ``import`` / ``from ... import`` written at a module's top level or inside an ``if`` at
top level (imports inside functions are deferred on purpose and do not count). An import of a
package counts its ``__init__``; ``from pkg import name`` counts ``pkg.name`` when that is a
module, else ``pkg``. The parents that importing ``a.b.c`` initialises first do not count: a
package's ``__init__`` re-exporting its own modules is not a cycle."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / d for d in ("common", "operator", "serving", "kvtransfer", "devcluster")]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for src in SOURCES:
        for path in src.glob("dsv4_*/**/*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports at module level, also under top-level ``if``/``try`` (``TYPE_CHECKING``)."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def _edges(name: str, tree: ast.Module, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` (whose source is ``tree``) imports at module level."""
    package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _top_level_imports(tree):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for a in node.names:
            sub = f"{base}.{a.name}"
            targets.add(sub if sub in modules else base)
    return {t for t in targets if t in modules and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _edges(name, ast.parse(path.read_text(), str(path)), modules)
        for name, path in modules.items()
    }


def test_the_graph_sees_relative_typing_and_package_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n"
        "from . import c\nimport p.q\ndef f():\n    import late\n"
    )
    modules = {m: Path(m.replace(".", "/") + ".py") for m in ("p.a", "p.b", "p.c", "p.q", "late")}
    modules["p"] = Path("p/__init__.py")
    assert _edges("p.a", tree, modules) == {"p.b", "p.c", "p.q"}
    assert "dsv4_common" in _graph() and len(_graph()) > 100


def test_no_module_level_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
