"""The house has no import cycle, and no import inside a function hides one.

Every import statement of every labkit module is read from its source (those at module
level and those inside functions alike; imports under `if TYPE_CHECKING:` aside, they never
run) and drawn as an arrow between modules. Importing `labkit.a.b` runs `labkit/a/__init__.py`
too, so it is an arrow to that package as well. A cycle among the arrows fails the test, and
so does an import of a labkit module inside a function that `DEFERRED` does not name with its
reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"

DEFERRED = {
    # the fenced fast path: a run with fast=False loads no module of labkit.fast
    ("labkit.model.rollout", "labkit.fast"): "fast path",
    ("labkit.model.scoring", "labkit.fast"): "fast path",
    ("labkit.model.learner", "labkit.fast.allocator"): "fast path",
    ("labkit.model.learner", "labkit.fast.support"): "fast path",
    ("labkit.bench.report", "labkit.fast.kernels"): "fast path",
    ("labkit.bench.floor", "labkit.fast.kernels"): "fast path",
    ("labkit.bench.timing", "labkit.fast.decoder"): "fast path",
    ("labkit.bench.timing", "labkit.fast.training"): "fast path",
    ("labkit.bench.inputs", "labkit.fast.decoder"): "fast path",
    # optional dependencies: peft, ray, and the code task's sandbox (a C build)
    ("labkit.model.learner", "labkit.model.lora"): "peft, optional",
    ("labkit.lab.commands", "labkit.lab.on_ray"): "ray, optional",
    ("labkit.lab.sweeps", "labkit.lab.on_ray"): "ray, optional",
    ("labkit.settings.preflight", "labkit.sandbox.launch"): "the code task's sandbox",
    ("labkit.run.rundir", "labkit.sandbox"): "the code task's sandbox",
    ("labkit.problems.code_tasks", "labkit.sandbox"): "the code task's sandbox",
}
"""(importer, imported) -> why the import waits until a function runs."""

DEFERRING_MODULES = {
    "labkit.__main__": "the command line loads only what the command it runs needs",
    "labkit.bench.workers": "each measurement runs in a fresh process, and what it loads, and "
                            "when, is part of what it measures",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """(imported names, in a function?) of every import that runs."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for rest in child.orelse:
                    yield from walk(rest, in_function)
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, ast.Import):
                yield [a.name for a in child.names], inside
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield [child.module] + [f"{child.module}.{a.name}" for a in child.names], inside
            yield from walk(child, inside)
    yield from walk(tree, False)


def arrows() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """module -> the labkit modules it imports; the (importer, imported) pairs imported inside
    a function."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    deferred = set()
    for name, path in modules.items():
        own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 2)}
        for names, in_function in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            found = [t for t in names if t in modules]
            for target in found:
                parts = target.split(".")
                reached = {".".join(parts[:k]) for k in range(1, len(parts) + 1)} - own
                graph[name] |= reached & set(modules)
                deepest = not any(t.startswith(target + ".") for t in found)
                if in_function and deepest and target not in own:
                    deferred.add((name, target))
    return graph, deferred


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_house_has_no_import_cycle():
    graph, _ = arrows()
    assert cycles(graph) == []


def test_an_import_inside_a_function_is_only_for_the_fast_path_or_an_optional_dependency():
    _, deferred = arrows()
    deferred = {(a, b) for a, b in deferred if a not in DEFERRING_MODULES}
    named = {(a, b) for a, b in deferred if (a, b) in DEFERRED}
    assert deferred - named == set()
    assert set(DEFERRED) - deferred == set()  # no stale entry


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    source = "import labkit.b\n\ndef f():\n    from labkit.a import x\n"
    imports = list(_imports(ast.parse(source)))
    assert imports == [(["labkit.b"], False), (["labkit.a", "labkit.a.x"], True)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
