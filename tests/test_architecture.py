"""The layering of docs/architecture.md, checked on the imports of every module (also the
imports inside functions)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trainkit"

PURE = ("step", "model", "precision", "remat", "metrics", "losses", "optimizers", "state")
FORBIDDEN = {  # module (or package prefix) -> trainkit modules it must not import
    "loop": ("trainer", "strategies", "callbacks", "checkpoint"),
    "callbacks": ("trainer", "strategies"),
    "program": ("trainer", "loop", "callbacks"),
    "plan": ("trainer", "loop", "callbacks"),
    "checkpoint": ("trainer", "loop", "callbacks", "strategies"),
    "strategies": ("trainer", "loop", "callbacks", "checkpoint", "program", "plan", "step", "data"),
    "data": ("trainer", "loop", "callbacks", "strategies", "checkpoint", "program", "plan"),
    "sources": ("trainer", "loop", "callbacks", "strategies", "checkpoint", "program", "plan"),
    **{
        name: ("trainer", "loop", "callbacks", "strategies", "checkpoint", "program", "plan", "data")
        for name in ("loggers", "throughput", "plot", "compile_cache")
    },
    "prefetch": ("trainer", "loop", "callbacks", "strategies", "checkpoint", "program", "plan", "data"),
    "debug": ("trainer", "loop", "callbacks"),
    **{name: ("trainer", "loop", "callbacks", "strategies", "checkpoint", "program", "plan") for name in PURE},
}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__") or "__init__", path


def imported(path):
    """The trainkit modules a file imports, as dotted names below ``trainkit``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainkit"):
            base = node.module.removeprefix("trainkit").lstrip(".")
            if base:
                found.add(base)
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("trainkit.") for a in node.names if a.name.startswith("trainkit."))
    return found


@pytest.mark.parametrize("name,path", list(modules()), ids=[name for name, _ in modules()])
def test_imports_point_down(name, path):
    imports = imported(path)
    if name != "__init__":
        assert "trainer" not in imports, f"{name} imports trainer.py: nothing may"
    rules = [rule for prefix, rule in FORBIDDEN.items() if name == prefix or name.startswith(prefix + ".")]
    for rule in rules:
        wrong = sorted(i for i in imports if i.split(".")[0] in rule)
        assert not wrong, f"trainkit.{name} imports {wrong}, which docs/architecture.md forbids"


def test_pmap_lives_in_data_parallel_only():
    users = [name for name, path in modules() if "jax.pmap(" in path.read_text()]
    assert users == ["strategies.data_parallel"]


def test_the_rules_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from trainkit import trainer\nfrom trainkit.strategies import base\n")
    assert imported(bad) == {"trainer", "strategies"}
