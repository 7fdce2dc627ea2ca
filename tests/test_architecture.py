"""The layering of docs/architecture.md, checked on the imports of every module (also the
imports inside functions): which package may import which, no import cycle, few top-level
modules, no probing of trainkit's own objects."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trainkit"

#: package -> the trainkit packages it may import (besides itself and ``version``)
ALLOWED = {
    "core": set(),
    "distributed": set(),
    "objective": {"core"},
    "data": {"core"},
    "strategies": {"core", "distributed"},
    "program": {"core", "objective", "data", "strategies", "distributed", "loop"},  # loop: FitConfig, a type
    "loop": {"core", "data", "distributed", "strategies"},
    "checkpoint": {"core", "distributed"},
    "monitoring": {"core", "loop", "distributed"},
    "callbacks": {"core", "loop", "checkpoint", "monitoring", "distributed"},
    "export": {"data", "distributed"},
    # thin entry points at the top level
    "launch": {"distributed"},
    "plot": {"monitoring"},
    "version": set(),
    "tuning_and_export": {"core", "data", "distributed", "export", "callbacks", "program", "strategies"},  # the facade
}
#: modules that may import every package: the facade and the public namespace
EVERYTHING = {"trainer", "__init__"}
FACADE_LIMIT = 350  # lines of trainer.py: a facade, Keras signatures in, delegation out
TOP_LEVEL_LIMIT = 6  # .py files directly in trainkit/, __init__ included
PROBE_LIMIT = 40  # getattr / hasattr calls, each on a third-party object (a user's callable, a JAX or torch type)


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__") or "__init__", path


MODULES = dict(modules())


def imported(path):
    """The trainkit modules a file imports, as dotted names below ``trainkit`` (a name imported
    from a package is that submodule when it is one, else the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainkit"):
            base = node.module.removeprefix("trainkit").lstrip(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if candidate in MODULES else base or alias.name)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("trainkit.") for a in node.names if a.name.startswith("trainkit."))
    return found


def package_of(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    imports = imported(MODULES[name])
    if name not in EVERYTHING:
        assert "trainer" not in imports, f"{name} imports trainer.py: nothing may"
    if name in EVERYTHING:
        return
    own = package_of(name)
    assert own in ALLOWED, f"trainkit.{name} is in no package of docs/architecture.md; add it to one"
    wrong = sorted(i for i in imports if package_of(i) not in ALLOWED[own] | {own, "version"})
    assert not wrong, f"trainkit.{name} imports {wrong}; {own}/ may import only {sorted(ALLOWED[own])}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or ``None``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = {name: {i for i in imported(path) if i in MODULES and i != name} for name, path in MODULES.items()}
    graph.pop("__init__")  # the public namespace imports everything; nothing imports it
    for edges in graph.values():
        edges.discard("__init__")
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_few_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} top-level modules: {top}; move code into a package"


def test_every_package_says_what_it_is_for():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split(". ")[0]) > 20, f"{init.parent.name}/__init__.py needs a one-line responsibility"


def probes() -> list[str]:
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                found.append(f"{name}:{node.lineno}")
    return found


def test_capabilities_are_declared_not_probed():
    found = probes()
    assert len(found) <= PROBE_LIMIT, f"{len(found)} getattr/hasattr calls (at most {PROBE_LIMIT}): {found}"


def test_the_facade_stays_small():
    lines = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert lines <= FACADE_LIMIT, f"trainer.py has {lines} lines; move work out of the facade"


def test_pmap_lives_in_data_parallel_only():
    users = [name for name, path in MODULES.items() if "jax.pmap(" in path.read_text()]
    assert users == ["strategies.data_parallel"]


def test_the_rules_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from trainkit import trainer\nfrom trainkit.strategies import base\n")
    assert imported(bad) == {"trainer", "strategies.base"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
