"""Imports between tunelab modules: no cycles, and each package imports only layers below it.

The layers are documented in docs/architecture.md ("Layers"); this test is their definition.
Imports are read with ``ast`` from the source, nothing is imported.
"""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "framework" / "tunelab"
RECIPES_DIR = ROOT / "recipes"

# Bottom to top. A module may import modules of its own unit and of units in lower layers.
# A unit is named by module prefixes; the longest prefix that matches a module wins, and the
# root package ``tunelab`` matches only itself.
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {
        "foundation": (
            "tunelab",
            "tunelab.errors",
            "tunelab._fs",
            "tunelab._model_files",
            "tunelab._paths",
            "tunelab._rng",
            "tunelab._torch_compat",
            "tunelab._library_noise",
            "tunelab._process_exit",
            "tunelab._json_lines",
            "tunelab._hub",
        ),
    },
    # Settings are read by everything: right above the foundation.
    {"config": ("tunelab.config",)},
    {
        "modules": ("tunelab.modules",),
        "distributed": ("tunelab.distributed",),
        # The file formats: read by models, peft, lifecycle, checkpointing and the CLI, and free
        # of training state.
        "formats": ("tunelab.formats",),
    },
    # The run folder and process start-up (recipe_main), stop signals, the launcher watch.
    {"lifecycle": ("tunelab.lifecycle",)},
    {
        "models": ("tunelab.models",),
        "peft": ("tunelab.peft",),
        "data": ("tunelab.data",),
        "losses": ("tunelab.losses",),
    },
    {"checkpoint": ("tunelab.checkpoint",)},
    {"training": ("tunelab.training",), "generation": ("tunelab.generation",)},
    # Online RL (rollouts, rewards, advantages, the policy losses): runs the training forward.
    {"rl": ("tunelab.rl",)},
    # Knowledge distillation: the teacher, and on-policy batches from the RL sampler.
    {"distill": ("tunelab.distill",)},
    # Benchmarks (lm-eval) on the model: scoring and generation with the training parts.
    {"eval": ("tunelab.eval",)},
    {"cli": ("tunelab.cli",), "assets": ("tunelab.assets",), "recipes": ("recipes",)},
]

# Imports inside a function that reach up or sideways, each for a stated reason. Anything
# else that does is a layering violation, deferred or not.
DEFERRED_EXCEPTIONS: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    deferred: bool  # inside a function, or only for type checking
    type_only: bool  # only for type checking: never runs
    implicit: bool  # a package that Python initialises before the named module


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    for path in sorted(RECIPES_DIR.glob("*.py")):
        files[f"recipes.{path.stem}"] = path
    return files


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    body: list[ast.stmt], deferred: bool, type_only: bool = False
) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """Every import statement, whether it runs after the module has been imported, and
    whether it is only for type checking (never runs)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, deferred, type_only
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _import_nodes(node.body, True, type_only)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, True, True)
            yield from _import_nodes(node.orelse, deferred, type_only)
        else:
            # Class bodies, if/try/with blocks at module level run at import time.
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    yield from _import_nodes(block, deferred, type_only)


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[importer].name == "__init__.py"
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _tunelab_targets(importer: str, node: ast.stmt) -> Iterator[tuple[str, bool]]:
    """The tunelab modules an import statement runs, each with whether it is implicit."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        module = _absolute(importer, node)
        # `from package import submodule` imports the submodule; other names come from module.
        names = [
            f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
            for alias in node.names
        ]
    for name in dict.fromkeys(names):
        if name.split(".")[0] != "tunelab":
            continue
        # Importing a.b.c also runs the packages a.b and a first, except those the importer
        # already lives in (they are initialised before it).
        # Those count for cycles; for layers only the named module does.
        parts = name.split(".")
        for end in range(len(parts), 1, -1):
            prefix = ".".join(parts[:end])
            if importer == prefix or importer.startswith(prefix + "."):
                break
            if prefix in MODULES:
                yield prefix, end < len(parts)


def _imports() -> list[Import]:
    found = []
    for importer, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, deferred, type_only in _import_nodes(tree.body, False):
            for target, implicit in _tunelab_targets(importer, node):
                found.append(Import(importer, target, node.lineno, deferred, type_only, implicit))
    return found


IMPORTS = _imports()


def _unit_of(module: str) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for level, layer in enumerate(LAYERS):
        for unit, prefixes in layer.items():
            for prefix in prefixes:
                matches = module == prefix or (
                    prefix != "tunelab" and module.startswith(prefix + ".")
                )
                if matches and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), level, unit)
    return None if best is None else (best[1], best[2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    missing = sorted(module for module in MODULES if _unit_of(module) is None)
    assert not missing, f"add these modules' packages to LAYERS: {missing}"


def _graph(*, with_deferred: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for item in IMPORTS:
        runs = not item.type_only and (with_deferred or not item.deferred)
        if runs and item.importer != item.target:
            graph.setdefault(item.importer, set()).add(item.target)
    return graph


def test_no_import_cycles_at_module_level():
    cycle = _cycle(_graph(with_deferred=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_counting_imports_inside_functions():
    # An import inside a function that closes a circle only hides it until the call: a
    # module that needs another one's internals belongs below it, or they are one module.
    cycle = _cycle(_graph(with_deferred=True))
    assert cycle is None, "import cycle through a deferred import: " + " -> ".join(cycle or [])


def _package_graph() -> dict[str, set[str]]:
    """The units of LAYERS (packages) and the units each imports, every import that can run."""
    graph: dict[str, set[str]] = {}
    for item in IMPORTS:
        importer, target = _unit_of(item.importer), _unit_of(item.target)
        if item.type_only or importer is None or target is None or importer == target:
            continue
        graph.setdefault(importer[1], set()).add(target[1])
    return graph


def test_no_import_cycles_between_packages():
    # Modules can avoid a cycle while their packages still import each other (checkpoint's
    # client imported peft, and peft's adapter writer checkpoint's layout): then neither package
    # can be understood, tested or moved without the other. Deferred imports count too.
    cycle = _cycle(_package_graph())
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_imports_follow_the_layers():
    violations = []
    for item in IMPORTS:
        if item.implicit:
            continue
        importer, target = _unit_of(item.importer), _unit_of(item.target)
        if importer is None or target is None or importer[1] == target[1]:
            continue
        if target[0] < importer[0]:
            continue
        if item.deferred and (item.importer, item.target) in DEFERRED_EXCEPTIONS:
            continue
        violations.append(
            f"{MODULES[item.importer].relative_to(ROOT)}:{item.line}: {item.importer} "
            f"({importer[1]}) imports {item.target} ({target[1]}), not a lower layer"
        )
    assert not violations, "\n".join(violations)


def test_deferred_exceptions_are_still_needed():
    present = {(item.importer, item.target) for item in IMPORTS if item.deferred}
    assert DEFERRED_EXCEPTIONS <= present, DEFERRED_EXCEPTIONS - present


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import tunelab.peft as peft", [("tunelab.peft", False)]),
        (
            "from tunelab.checkpoint import dcp",
            [("tunelab.checkpoint.dcp", False), ("tunelab.checkpoint", True)],
        ),
        ("from tunelab.checkpoint import CheckpointClient", [("tunelab.checkpoint", False)]),
        ("from tunelab.data.chat import x", [("tunelab.data.chat", False)]),
        ("from . import rows", [("tunelab.data.rows", False)]),
        ("import torch", []),
    ],
)
def test_import_resolution(source, expected):
    node = ast.parse(source).body[0]
    assert list(_tunelab_targets("tunelab.data.sft", node)) == expected


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
