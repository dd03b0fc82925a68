"""Read what a tunelab module defines from its source, without importing it.

``tunelab validate`` must answer in well under two seconds, and importing any module that
imports torch costs more than one. The components of the built-in configs
(``tunelab.training.adamw``, ``tunelab.data.instruct_dataset``, ...) live in such modules, so
their signatures are read from the source instead: the dotted path is followed through the
package's ``from x import y`` re-exports to the ``def`` or ``class`` that defines it, and the
parameters come from its argument list. Anything this cannot decide for certain (a decorator,
an inherited ``__init__`` from outside tunelab, a name bound by an assignment) answers None,
and the caller imports the object instead. A unit test checks that every public callable of the
tunelab packages reads the same here as ``inspect.signature`` says after an import.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PACKAGE = "tunelab"
_ROOT = Path(__file__).resolve().parents[1]
_MAX_HOPS = 12


class _HasDefault:
    def __repr__(self) -> str:
        return "..."


# Stands for "has a default" in a signature read from source; the value itself is not needed.
HAS_DEFAULT = _HasDefault()
_CLASS_DECORATORS = {"dataclass", "dataclasses.dataclass"}


@dataclass(frozen=True)
class StaticCallable:
    """A function or class found in the source.

    Attributes:
        name: Its defining module and qualified name, e.g. ``tunelab.training.optim.adamw``.
        signature: Its parameters (a class's without ``self``); defaults are ``HAS_DEFAULT``.
    """

    name: str
    signature: inspect.Signature


@dataclass(frozen=True)
class StaticMissing:
    """A module the user named directly has no such attribute.

    Attributes:
        owner: The dotted path of the module, as the user wrote it.
        attribute: The missing name.
        known: The module's public names, for a did-you-mean.
    """

    owner: str
    attribute: str
    known: tuple[str, ...]


@dataclass(frozen=True)
class _Binding:
    kind: str  # "function", "class", "import", "module" or "other"
    node: Any = None
    module: str = ""  # import: the module the name comes from; module: the module itself
    name: str = ""  # import: the name inside that module


def module_file(module: str) -> Path | None:
    """Return the source file of a ``tunelab`` module or package, or None if it has none."""
    parts = module.split(".")
    if parts[0] != _PACKAGE:
        return None
    folder = _ROOT
    for index, part in enumerate(parts[1:], start=1):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
        elif index == len(parts) - 1 and (folder / f"{part}.py").is_file():
            return folder / f"{part}.py"
        else:
            return None
    return folder / "__init__.py"


def _parse(path: Path | None) -> ast.Module | None:
    """The syntax tree of a source file; None when there is none or it cannot be read."""
    if path is None:
        return None
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _bound_names(statement: ast.stmt) -> set[str]:
    """Every name a statement may bind, looking inside if/try/with/for bodies."""
    names: set[str] = set()
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


@functools.cache
def _namespace(module: str) -> dict[str, _Binding] | None:
    """The top-level names of a module's source; None if they cannot all be known."""
    path = module_file(module)
    tree = _parse(path)
    if path is None or tree is None:
        return None
    is_package = path.name == "__init__.py"
    names: dict[str, _Binding] = {}
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if statement.name == "__getattr__":  # Attributes made up at run time.
                return None
            names[statement.name] = _Binding("function", statement)
        elif isinstance(statement, ast.ClassDef):
            names[statement.name] = _Binding("class", statement)
        elif isinstance(statement, ast.ImportFrom):
            source = _absolute(module, is_package, statement)
            for alias in statement.names:
                if alias.name == "*":
                    return None
                names[alias.asname or alias.name] = _Binding(
                    "import", module=source, name=alias.name
                )
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    names[alias.asname] = _Binding("module", module=alias.name)
                else:
                    top = alias.name.split(".")[0]
                    names[top] = _Binding("module", module=top)
        else:
            for name in _bound_names(statement):
                names[name] = _Binding("other")
    return names


def _parameters(arguments: ast.arguments, *, drop_first: bool) -> inspect.Signature:
    kinds = inspect.Parameter
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    params = []
    for index, argument in enumerate(positional):
        kind = (
            kinds.POSITIONAL_ONLY
            if index < len(arguments.posonlyargs)
            else kinds.POSITIONAL_OR_KEYWORD
        )
        default = HAS_DEFAULT if index >= first_default else kinds.empty
        params.append(kinds(argument.arg, kind, default=default))
    if arguments.vararg:
        params.append(kinds(arguments.vararg.arg, kinds.VAR_POSITIONAL))
    for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        value = kinds.empty if default is None else HAS_DEFAULT
        params.append(kinds(argument.arg, kinds.KEYWORD_ONLY, default=value))
    if arguments.kwarg:
        params.append(kinds(arguments.kwarg.arg, kinds.VAR_KEYWORD))
    if drop_first:
        params = params[1:]
    return inspect.Signature(params)


def _decorator_names(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    names = []
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.append(ast.unparse(target))
    return names


def _class_signature(node: ast.ClassDef, module: str, hops: int) -> inspect.Signature | None:
    decorators = _decorator_names(node)
    if any(name not in _CLASS_DECORATORS for name in decorators) or node.keywords:
        return None  # A metaclass or an unknown decorator may change how it is called.
    methods = {
        item.name: item
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    if "__new__" in methods or "__signature__" in methods:
        return None
    init = methods.get("__init__")
    if init is not None:
        return None if init.decorator_list else _parameters(init.args, drop_first=True)
    if decorators:
        return None  # A dataclass's generated __init__: leave it to the import.
    bases = [ast.unparse(base) for base in node.bases if ast.unparse(base) != "object"]
    if not bases:
        return inspect.Signature([])
    if len(bases) == 1 and isinstance(node.bases[0], ast.Name):
        found = _lookup(module, [bases[0]], hops + 1, direct=False)
        if isinstance(found, StaticCallable):
            return found.signature
    return None


def _method_signature(node: ast.ClassDef, name: str) -> inspect.Signature | None:
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            decorators = _decorator_names(item)
            if decorators == ["classmethod"]:
                return _parameters(item.args, drop_first=True)
            if decorators in (["staticmethod"], []):
                return _parameters(item.args, drop_first=False)
            return None
    return None


def _lookup(
    module: str, attributes: list[str], hops: int, direct: bool
) -> StaticCallable | StaticMissing | None:
    if hops > _MAX_HOPS:
        return None
    names = _namespace(module)
    if names is None:
        return None
    name, rest = attributes[0], attributes[1:]
    binding = names.get(name)
    if binding is None:
        if module_file(f"{module}.{name}") is not None:
            # A submodule is an attribute only once something imported it.
            return _lookup(f"{module}.{name}", rest, hops + 1, direct) if rest else None
        if not direct:
            return None  # A broken re-export; the import will say what is wrong.
        known = tuple(sorted(n for n in names if not n.startswith("_")))
        return StaticMissing(module, name, known)
    if binding.kind == "import":
        if module_file(f"{binding.module}.{binding.name}") is not None:  # from pkg import mod
            submodule = f"{binding.module}.{binding.name}"
            return _lookup(submodule, rest, hops + 1, direct=False) if rest else None
        return _lookup(binding.module, [binding.name, *rest], hops + 1, direct=False)
    if binding.kind == "module":
        return _lookup(binding.module, rest, hops + 1, direct=False) if rest else None
    if binding.kind == "function" and not rest:
        if binding.node.decorator_list:
            return None
        return StaticCallable(f"{module}.{name}", _parameters(binding.node.args, drop_first=False))
    if binding.kind == "class" and not rest:
        signature = _class_signature(binding.node, module, hops)
        return StaticCallable(f"{module}.{name}", signature) if signature else None
    if binding.kind == "class" and len(rest) == 1:
        signature = _method_signature(binding.node, rest[0])
        return StaticCallable(f"{module}.{name}.{rest[0]}", signature) if signature else None
    return None


def resolve_static(dotted: str) -> StaticCallable | StaticMissing | None:
    """Find the function or class a ``tunelab.*`` dotted path names, from source only.

    Args:
        dotted: A dotted path such as ``tunelab.training.adamw``.

    Returns:
        The callable and its signature; a ``StaticMissing`` when the module the path names has
        no such attribute; None when the source cannot say for certain (import it instead).
    """
    parts = dotted.split(".")
    if parts[0] != _PACKAGE or len(parts) < 2:
        return None
    for split in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:split])
        if module_file(module) is None:
            continue
        return _lookup(module, parts[split:], 0, direct=True)
    return None


def supported_model_types() -> dict[str, str] | None:
    """Return what ``tunelab.models.families.FAMILIES`` supports, read from its source.

    Returns:
        A mapping from ``model_type`` to the HF architecture name of each family, or None
        when the source does not have the expected shape (then import the package instead).
    """
    tree = _parse(module_file("tunelab.models.families"))
    if tree is None:
        return None
    for statement in tree.body:
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        elif isinstance(statement, ast.Assign):
            targets = statement.targets
        else:
            continue
        if [ast.unparse(target) for target in targets] != ["FAMILIES"]:
            continue
        if not isinstance(statement.value, ast.Dict):
            return None
        found: dict[str, str] = {}
        for key, value in zip(statement.value.keys, statement.value.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return None
            architecture = _adapter_architecture(value)
            if architecture is None:
                return None
            found[key.value] = architecture
        return found
    return None


def _adapter_architecture(family: ast.expr) -> str | None:
    # FAMILIES values are Family(args_from_hf, AdapterClass); the class says its architecture.
    if not (isinstance(family, ast.Call) and len(family.args) == 2):
        return None
    adapter = family.args[1]
    if not isinstance(adapter, ast.Name):
        return None
    names = _namespace("tunelab.models.families") or {}
    binding = names.get(adapter.id)
    if binding is None or binding.kind != "import":
        return None
    class_node = (_namespace(binding.module) or {}).get(binding.name)
    if class_node is None or class_node.kind != "class":
        return None
    for item in class_node.node.body:
        if (
            isinstance(item, ast.Assign)
            and [ast.unparse(t) for t in item.targets] == ["architecture"]
            and isinstance(item.value, ast.Constant)
        ):
            return item.value.value
    return None
