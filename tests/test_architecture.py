"""The layering of docs/architecture.md, checked on the imports of every module (also the
imports inside functions): which package may import which, no import cycle, few top-level
modules, no probing of trainkit's own objects; and the ownership of a run's state: the loop and
the setup assign no other object's attributes and snapshot nothing with ``vars``, the facade
(with everything it inherits) stays small, no function is long, one ``PyTree`` alias."""

import ast
import importlib
import math
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "trainkit"

#: package -> the trainkit packages it may import (besides itself and ``version``)
ALLOWED = {
    "core": set(),
    "distributed": set(),
    "record": {"core"},
    "objective": {"core"},
    "data": {"core"},
    # tk.attention, its kernels, its context split and the doors to a model's own attention
    "attn": {"core"},
    "strategies": {"core", "distributed", "attn"},
    # plans and memory (#82: program/ split by job): a plan reads the step it is given, never the setup
    "planning": {"core", "distributed", "attn", "data", "strategies"},
    "program": {"core", "record", "objective", "data", "strategies", "distributed", "weights", "attn", "planning"},
    "weights": {"core", "distributed"},
    "loop": {"core", "record", "data", "distributed", "strategies"},
    "checkpoint": {"core", "record", "distributed"},
    "monitoring": {"core", "record", "loop", "strategies", "distributed"},
    "callbacks": {"core", "record", "loop", "checkpoint", "monitoring", "distributed"},
    "export": {"core", "data", "distributed"},
    # thin entry points at the top level
    "launch": {"distributed"},
    "plot": {"monitoring"},
    # python -m trainkit plan: through the trainer the user's script returns, the target's spelling
    # checked first (planning/targets.py, which imports JAX only when it compiles)
    "__main__": {"program", "planning"},
    "version": set(),
    # JAX's, Flax's and qwix's internals, each behind one named function; imports nothing of trainkit's
    "internals": set(),
}
for _package, _allowed in ALLOWED.items():  # every package may reach JAX's internals, through internals/ only
    if _package != "internals":
        _allowed.add("internals")
#: the modules of JAX and qwix that are not their public API: imported by internals/ only
PRIVATE_MODULES = ("jax._src", "jax.extend", "qwix._src")
#: modules that may import every package: the facade and the public namespace
EVERYTHING = {"trainer", "__init__"}
#: namespaces whose names are imported on first use (a ``LAZY`` table): the type checker reads
#: the same names from their ``if TYPE_CHECKING:`` imports (the launcher starts without JAX)
LAZY_NAMESPACES = {"__init__": "trainkit", "distributed": "trainkit.distributed"}
#: lines of trainer.py and every trainkit module it inherits from: Keras signatures in, delegation out
#: (375 until #58 put the custom step's public surface on it: train_step, test_step and four helpers; since #82
#: formatted as ruff formats it, no '# fmt: skip': 370, trainkit's own options typed as **options)
FACADE_LIMIT = 370
FUNCTION_LIMIT = 80  # lines of any function or method in trainkit/
PROGRAM_FUNCTION_LIMIT = 60  # in program/ and planning/, the package that grew most, split by job (#82)
#: where a run's state is read and replaced only through the session's methods
OWNERSHIP_CHECKED = ("loop", "program.setup")
TOP_LEVEL_LIMIT = 6  # .py files directly in trainkit/, __init__ included
PROBE_LIMIT = 40  # getattr / hasattr calls, each on a third-party object (a user's callable, a JAX or torch type)
ANY_LIMIT = 125  # ``Any`` in annotations (parameters, returns, annotated names): each removal a real type


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__") or "__init__", path


MODULES = dict(modules())


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:`` (read by the type checker only)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            found.update(id(child) for child in ast.walk(node))
    return found


def imported(path, *, typing_only=False):
    """The trainkit modules a file imports, as dotted names below ``trainkit`` (a name imported
    from a package is that submodule when it is one, else the package). The imports under ``if
    TYPE_CHECKING:`` are left out unless ``typing_only``: then only they are listed."""
    found = set()
    tree = ast.parse(path.read_text())
    checking = _type_checking_only(tree)
    for node in ast.walk(tree):
        if (id(node) in checking) != typing_only:
            continue
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
    for_types = imported(MODULES[name], typing_only=True)
    if name not in LAZY_NAMESPACES:  # those import for types exactly what they import lazily (checked below)
        assert not for_types, (
            f"{name} imports {sorted(for_types)} for types only: import them, or type against a protocol "
            "(the callbacks read the trainer as a callbacks.trainer_view.TrainerView)"
        )
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


@pytest.mark.parametrize("name", sorted(LAZY_NAMESPACES))
def test_a_lazy_namespace_imports_for_types_what_it_imports_on_first_use(name):
    """Each name of ``__all__`` is in the ``LAZY`` table, is imported for the type checker
    under the same name, and resolves to that module's attribute."""
    module = importlib.import_module(LAZY_NAMESPACES[name])
    tree = ast.parse(MODULES[name].read_text())
    checking = _type_checking_only(tree)
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if id(node) in checking and isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert set(module.__all__) - {"__version__"} == set(module.LAZY) == typed
    for public, (where, attribute) in module.LAZY.items():
        target = importlib.import_module(where)
        assert getattr(module, public) is (target if attribute is None else getattr(target, attribute)), public


def test_the_launcher_and_import_trainkit_start_without_jax():
    code = "import sys, trainkit, trainkit.distributed.launch; print(sorted({'jax', 'flax'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


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


def internal_reaches(tree: ast.Module) -> list[str]:
    """Imports of (and names written as strings for) JAX's and qwix's private modules."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names = [node.value]
        found += [f"line {node.lineno}: {name}" for name in names if name.startswith(PRIVATE_MODULES)]
    return found


def attribute_settings(tree: ast.Module) -> list[str]:
    """``setattr(x, ...)`` and ``object.__setattr__(x, ...)`` on anything but ``self`` (a frozen dataclass
    setting its own fields is fine)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        plain = isinstance(node.func, ast.Name) and node.func.id == "setattr"
        forced = isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"
        target = node.args[0]
        if (plain or forced) and not (isinstance(target, ast.Name) and target.id == "self"):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}({ast.unparse(target)}, ...)")
    return found


@pytest.mark.parametrize("name", sorted(n for n in MODULES if package_of(n) != "internals"))
def test_jax_internals_are_reached_through_internals_only(name):
    """Outside internals/, no module imports ``jax._src`` / ``jax.extend`` / ``qwix._src``; under core/,
    none sets an attribute on an object it does not own (a module's function, a frozen module's field)."""
    tree = ast.parse(MODULES[name].read_text())
    reaches = internal_reaches(tree)
    assert not reaches, f"trainkit.{name} reaches {reaches}: add a named function to trainkit/internals/"
    if package_of(name) == "core":
        settings = attribute_settings(tree)
        assert not settings, f"trainkit.{name} sets {settings}: core/ mutates nothing it does not own"


def test_docs_name_every_module_in_one_line():
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    index = docs[docs.index("## Every module, one line each") :]
    listed = {line.split("`")[1] for line in index.splitlines() if line.startswith("- `")}
    files = {path.relative_to(PACKAGE).as_posix() for path in MODULES.values()}
    assert not files - listed, f"docs/architecture.md's module index lacks {sorted(files - listed)}: add one line each"
    assert not listed - files, f"docs/architecture.md names modules that are gone: {sorted(listed - files)}"


def any_annotations(tree: ast.Module) -> int:
    """How many times ``Any`` is written in the module's annotations (a parameter's, a return's, an
    annotated name's; in string annotations too)."""

    def count(node: ast.AST | None) -> int:
        if node is None:
            return 0
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == "Any"]
        names += [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "Any"]
        text = [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        return len(names) + sum(len(re.findall(r"\bAny\b", t.value)) for t in text)

    found = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            arguments += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            found += sum(count(a.annotation) for a in arguments) + count(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found += count(node.annotation)
    return found


def test_any_stays_rare():
    counts = {name: any_annotations(ast.parse(path.read_text())) for name, path in MODULES.items()}
    total = sum(counts.values())
    most = sorted(counts.items(), key=lambda item: -item[1])[:5]
    assert total <= ANY_LIMIT, (
        f"{total} Any in annotations (at most {ANY_LIMIT}); the most: {most}. Write the real type"
    )


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


def facade_lines() -> dict[str, int]:
    """The lines of ``Trainer`` and of every trainkit class it inherits from, by module."""
    import trainkit

    lines = {}
    for cls in trainkit.Trainer.__mro__:
        module = cls.__module__
        if module.startswith("trainkit"):
            path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
            lines[module] = len(path.read_text().splitlines())
    return lines


def test_the_facade_stays_small():
    lines = facade_lines()
    assert "trainkit.trainer" in lines
    # formatted as ruff formats: a packed block kept by ``# fmt: skip`` would only hide lines from the bound (#82)
    assert "fmt: skip" not in (PACKAGE / "trainer.py").read_text(), "trainer.py keeps a '# fmt: skip' block"
    assert sum(lines.values()) <= FACADE_LIMIT, f"the facade has {lines} lines; move work out of it"


def long_functions(tree: ast.Module, limit: int = FUNCTION_LIMIT) -> list[str]:
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_is_long(name):
    limit = PROGRAM_FUNCTION_LIMIT if name.startswith(("program.", "planning.")) else FUNCTION_LIMIT
    found = long_functions(ast.parse(MODULES[name].read_text()), limit)
    assert not found, f"trainkit.{name}: {found} over {limit} lines; split them"


def foreign_writes(tree: ast.Module) -> list[str]:
    """Assignments to another object's attributes (``other.x = ...``, ``a.b.c = ...``,
    ``setattr(other, ...)``) and ``vars(...)`` snapshots; ``self.x = ...`` is a class's own."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        pending = list(targets)
        while pending:  # the written places: attributes, containers of attributes, unpacked targets
            target = pending.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                pending.extend(target.elts)
            elif isinstance(target, (ast.Starred, ast.Subscript)):
                pending.append(target.value)
            elif isinstance(target, ast.Attribute) and not (
                isinstance(target.value, ast.Name) and target.value.id == "self"
            ):
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "vars"):
            own = node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
            if node.func.id == "vars" or not own:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_loop_and_the_setup_write_only_their_own_attributes():
    checked = [name for name in MODULES if name.startswith(OWNERSHIP_CHECKED)]
    assert "loop.fit_run" in checked and "program.setup" in checked
    for name in checked:
        found = foreign_writes(ast.parse(MODULES[name].read_text()))
        assert not found, f"trainkit.{name} writes what is not its own: {found}; call the owner's method instead"


def test_one_pytree_alias():
    aliases = [
        name
        for name, path in MODULES.items()
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "PyTree"
            for t in getattr(node, "targets", [getattr(node, "target", None)])
        )
    ]
    assert aliases == ["core.tree"], f"PyTree is defined in {aliases}; import it from trainkit.core.tree"


def test_pmap_lives_in_data_parallel_only():
    users = [name for name, path in MODULES.items() if "jax.pmap(" in path.read_text()]
    assert users == ["strategies.data_parallel"]


FEATURES = "core.features"
#: the one module that lists the train step's features (Steps.step_features)
FEATURE_REGISTRY = "program.steps"
STEP_PARAMETERS_LIMIT = 5  # make_train_step's parameters: the rest are features on one seam


def feature_rules(modules: dict[str, set[str]]) -> list[str]:
    """What breaks "a new feature touches its own file and the place it is registered": the
    core step importing a feature, a feature importing another, any module but the registry
    importing one (``modules``: a module's name to what it imports)."""
    broken = []
    features = {name for name in modules if name.startswith(FEATURES + ".")}
    for name, imports in sorted(modules.items()):
        used = sorted(imports & features)
        if name in features:
            others = [i for i in used if i != name]
            broken += [f"{name} imports the feature {i}: features know only the seam" for i in others]
        elif used and name != FEATURE_REGISTRY:
            broken.append(f"{name} imports {used}: only {FEATURE_REGISTRY} registers features")
    return broken


def test_each_step_feature_is_its_own_module_registered_in_one_place():
    graph = {name: imported(path) for name, path in MODULES.items()}
    assert [name for name in graph if name.startswith(FEATURES + ".")], "no feature modules found"
    assert not feature_rules(graph), feature_rules(graph)
    assert "core.step_feature" in graph["core.step"] and not graph["core.step"] & {
        n for n in graph if n.startswith(FEATURES)
    }
    step = next(
        node
        for node in ast.walk(ast.parse(MODULES["core.step"].read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "make_train_step"
    )
    count = len(step.args.args) + len(step.args.kwonlyargs)
    assert count <= STEP_PARAMETERS_LIMIT, f"make_train_step takes {count} parameters (at most {STEP_PARAMETERS_LIMIT})"


def test_the_rules_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from trainkit import trainer\nfrom trainkit.strategies import base\n")
    assert imported(bad) == {"trainer", "strategies.base"}
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainkit.trainer import Trainer\n")
    assert imported(typed) == set() and imported(typed, typing_only=True) == {"trainer"}
    writes = "class A:\n    def f(self, other):\n        self.x, d[k.i] = 1, 0\n"
    writes += "        other.y = 2\n        setattr(other, 'z', 3)\n"
    assert foreign_writes(ast.parse(writes + "        return vars(self)\n")) == [
        "line 4: other.y = ...",
        "line 5: setattr(other, 'z', 3)",
        "line 6: vars(self)",
    ]
    assert long_functions(ast.parse("def f():\n" + "    x = 1\n" * 80)) == ["f (81 lines, line 1)"]
    private = "from jax._src import xla_bridge\nimport jax.extend.core\nsys.modules.get('qwix._src.ptq')\n"
    assert internal_reaches(ast.parse(private)) == [
        "line 1: jax._src",
        "line 2: jax.extend.core",
        "line 3: qwix._src.ptq",
    ]
    assert any_annotations(ast.parse("def f(a: Any, *b: 'list[Any]') -> dict[str, Any]:\n    c: Any = 1\n")) == 4
    settings = "setattr(jax.nn, 'f', g)\nobject.__setattr__(module, 'x', 1)\nobject.__setattr__(self, 'y', 2)\n"
    assert attribute_settings(ast.parse(settings)) == [
        "line 1: setattr(jax.nn, ...)",
        "line 2: object.__setattr__(module, ...)",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    spread = {"core.features.a": {"core.features.b"}, "core.features.b": set(), "loop.x": {"core.features.a"}}
    assert feature_rules(spread) == [
        "core.features.a imports the feature core.features.b: features know only the seam",
        "loop.x imports ['core.features.a']: only program.steps registers features",
    ]


def test_attention_and_its_kernels_live_in_one_package():
    """#82: ``tk.attention``, the kernels it chooses from, its context split and the doors to a model's own
    attention are one package (``trainkit/attn/``), its choice made in ``kernels.choose`` and run in the
    one function ``dispatch.attention``: no module elsewhere runs a Pallas kernel or splits attention."""
    import trainkit as tk

    assert tk.attention.__module__ == "trainkit.attn.dispatch"
    kernel_words = re.compile(r"experimental\.pallas|splash_attention|split_attention|AttentionCall\(")
    outside = [n for n, path in MODULES.items() if package_of(n) != "attn" and kernel_words.search(path.read_text())]
    assert not outside, f"attention's kernels or split outside trainkit/attn/: {outside}"
    dispatch = MODULES["attn.dispatch"].read_text()
    public = re.findall(r"\ndef ([a-z]\w*)\(", dispatch)
    assert dispatch.count("kernels.choose(") == 1 and public == ["attention"], "one function decides and runs"


def test_one_table_of_chips():
    """#82: a chip's figures (peak flop/s, bandwidths, link rates) are written once, in core/chips.py, which MFU,
    the plan and its targets all read: no other module holds a figure of that size (a power of ten is a unit)."""
    figures = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, float) and value >= 1e9 and not math.log10(value).is_integer():
                figures.setdefault(name, []).append(value)
    assert set(figures) == {"core.chips"}, (
        f"chip figures outside core/chips.py: { {n: v for n, v in figures.items() if n != 'core.chips'} }"
    )


#: the packages a step passes through from the trainer to the compiled program (#82): none reads a user's
#: object by snapshotting its attributes
STEP_PATH = ("program", "loop", "strategies")


def test_a_step_is_a_value_not_read_from_bytecode_or_a_snapshot():
    """#82: the user's step is a value (``tk.Step``; an override runs through a frozen view of the trainer), so no
    module reads a function's bytecode (``dis``) and none on the step's path snapshots an object with ``vars()``."""
    readers, snapshots = [], []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                readers += [f"{name}:{node.lineno}" for m in modules if m.split(".")[0] in ("dis", "opcode")]
            calls_vars = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
            if calls_vars and package_of(name) in STEP_PATH:
                snapshots.append(f"{name}:{node.lineno}")
    assert not readers, f"bytecode read in {readers}: declare what the step needs as a value's field"
    step_imports = {
        node.module
        for node in ast.walk(ast.parse(MODULES["core.step"].read_text()))
        if isinstance(node, ast.ImportFrom)
    }
    assert "trainkit.core.custom_step" not in step_imports, (
        "the built-in step branches into the user's: the program chooses"
    )
    for module in ("program.program", "program.steps"):
        built = [name for name in ("make_train_step(", "make_eval_step(") if name in MODULES[module].read_text()]
        assert not built, f"{module} calls {built}: the built-in step is a value (core/loss_step.LossStep)"
    assert not snapshots, f"vars() on the step's path in {snapshots}: record what the step reads, as it reads it"


def test_one_trace_context_and_a_pure_core():
    """#82: what a step is traced under is one value in one ``ContextVar`` (core/trace_context.py), handed to the
    step once by the program's compile (the platform and the strategy's ``trace_parts``); core/ holds no mesh, no
    ``shard_map`` and no thread state: the mesh-aware code (the pipeline, GPipe, logical axis rules) lives in
    strategies/, which owns the mesh."""
    variables = [n for n, path in MODULES.items() if "ContextVar(" in path.read_text()]
    assert variables == ["core.trace_context"], f"ContextVars in {variables}: make it a part of core/trace_context"
    impure = re.compile(r"\bMesh\b|shard_map\(|NamedSharding|threading\.|with_sharding_constraint")
    found = [n for n, path in MODULES.items() if package_of(n) == "core" and impure.search(path.read_text())]
    assert not found, f"mesh or thread code in core/: {found}; it belongs to the package that owns the mesh"
    program = MODULES["program.program"].read_text()
    assert program.count("traced_under(") == 1 and "trace_parts()" in program, "the step's context handed once"
