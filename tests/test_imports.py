"""The product packages' import graph: no cycle anywhere in ``flows/``, ``nrl_tasks/`` and
``storage/`` (imports inside functions count: they run too; ``if TYPE_CHECKING:`` ones do not), and the generation backends never
import the policy (the LoRA helpers both use live in ``nrl_tasks/models/lora_adapters.py``).

The graph is read from the source (``ast``), so a module that is never imported still counts."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "nrl_tasks", "storage")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Product modules ``name`` imports (``from pkg import mod`` resolves to the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
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
                    out.append(sorted(component))
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert "nrl_tasks.stages.errors" in graph["nrl_tasks.stages.refit"]
    assert "flows.config" in graph["flows.run.resolve"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_generation_does_not_import_the_policy():
    bad = {
        (name, dep)
        for name, deps in _graph().items()
        if name.startswith("nrl_tasks.models.generation")
        for dep in deps
        if dep.startswith("nrl_tasks.models.policy")
    }
    assert bad == set()


#: the rooms of ``flows/`` from the bottom up: a module imports only from its own room or a lower
#: one (ARCHITECTURE.md, "Rooms and their direction"); ``nrl_tasks`` and ``storage`` never import ``flows``
FLOWS_LAYERS: tuple[tuple[str, ...], ...] = (
    ("flows.config",),
    ("flows.observe",),
    ("flows.run",),
    ("flows.algorithms",),
    ("flows.pipeline",),
    ("flows.cli_run", "flows.cli", "flows.demo"),
)


def _layer(module: str) -> int | None:
    for i, rooms in enumerate(FLOWS_LAYERS):
        if any(module == r or module.startswith(r + ".") for r in rooms):
            return i
    return None


def direction_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs against :data:`FLOWS_LAYERS` (also ``nrl_tasks``/``storage`` -> ``flows``).

    >>> direction_violations({"flows.config.io": {"flows.run.state"}, "flows.run.state": {"flows.config.io"}})
    [('flows.config.io', 'flows.run.state')]
    """
    bad = []
    for name, deps in graph.items():
        for dep in deps:
            if not dep.startswith("flows"):
                continue
            if not name.startswith("flows"):
                bad.append((name, dep))
                continue
            a, b = _layer(name), _layer(dep)
            if a is None or b is None or b > a:
                bad.append((name, dep))
    return sorted(bad)


def test_flows_rooms_import_downwards_only():
    assert all(_layer(m) is not None for m in _graph() if m.startswith("flows.")), "a flows module outside every room"
    assert direction_violations(_graph()) == []
