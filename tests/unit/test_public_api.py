"""The public API: each public module's ``__all__``, what recipes import, and docs/api.md.

Public modules are ``tunelab`` and its non-underscore children that define ``__all__``
(``tunelab.config``, ``tunelab.training``, ..., ``tunelab.generation``); their ``__all__`` is the
public API. Everything else is internal: tests may import it, recipes may not, since users copy
recipes (``tunelab cp``) and their copies must keep working when internals move.
"""

import ast
import importlib
import re
from pathlib import Path

import pytest

from tunelab.cli import builtin_recipes

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "framework" / "tunelab"
API_DOCS = ROOT / "docs" / "api.md"


def _defines_all(path: Path) -> bool:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(ast.unparse(target) == "__all__" for target in targets):
            return True
    return False


def _public_modules() -> dict[str, list[str]]:
    """Public module name to its ``__all__``."""
    found = {"tunelab": importlib.import_module("tunelab").__all__}
    for path in sorted(PACKAGE_DIR.iterdir()):
        source = path / "__init__.py" if path.is_dir() else path
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("_") or not source.is_file() or source.suffix != ".py":
            continue
        if _defines_all(source):
            found[f"tunelab.{name}"] = list(importlib.import_module(f"tunelab.{name}").__all__)
    return found


PUBLIC = _public_modules()


def _modules_with_all() -> list[str]:
    modules = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if _defines_all(path):
            modules.append(".".join(parts))
    return modules


def test_the_public_modules_are_the_documented_ones():
    assert set(PUBLIC) == {
        "tunelab",
        "tunelab.checkpoint",
        "tunelab.cli",
        "tunelab.config",
        "tunelab.data",
        "tunelab.distill",
        "tunelab.distributed",
        "tunelab.eval",
        "tunelab.generation",
        "tunelab.lifecycle",
        "tunelab.losses",
        "tunelab.models",
        "tunelab.modules",
        "tunelab.peft",
        "tunelab.rl",
        "tunelab.training",
    }


@pytest.mark.parametrize("module_name", _modules_with_all())
def test_every_name_in_every_all_resolves(module_name):
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    assert len(names) == len(set(names)), f"{module_name}.__all__ repeats a name"
    for name in names:
        assert name == "__version__" or not name.startswith("_"), f"{module_name}.{name}"
        assert getattr(module, name, None) is not None, f"{module_name}.{name} does not resolve"


def recipe_import_problems(source: str, filename: str = "recipe.py") -> list[str]:
    """What a recipe imports from tunelab that is not public, one line per import."""
    problems = []
    aliases: dict[str, str] = {}  # local name -> public module it stands for
    tree = ast.parse(source, filename)

    def where(node: ast.AST) -> str:
        return f"{filename}:{node.lineno}"

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tunelab":
            if node.module not in PUBLIC:
                problems.append(f"{where(node)}: imports from {node.module}, not a public module")
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" in PUBLIC:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name not in PUBLIC[node.module]:
                    problems.append(f"{where(node)}: {alias.name} is not in {node.module}.__all__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tunelab":
                    continue
                if alias.name not in PUBLIC:
                    problems.append(f"{where(node)}: imports {alias.name}, not a public module")
                elif alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases["tunelab"] = "tunelab"
    for node in ast.walk(tree):
        # module.name for a module imported above: a dotted access must name a public thing.
        if not isinstance(node, ast.Attribute):
            continue
        dotted = ast.unparse(node)
        head = dotted.split(".")[0]
        if head not in aliases or not isinstance(node.value, ast.Name | ast.Attribute):
            continue
        owner = ".".join([aliases[head], *dotted.split(".")[1:-1]])
        if (
            owner in PUBLIC
            and node.attr not in PUBLIC[owner]
            and f"{owner}.{node.attr}" not in (PUBLIC)
        ):
            problems.append(f"{where(node)}: {node.attr} is not in {owner}.__all__")
    return problems


def test_the_import_check_finds_private_imports():
    source = (
        "import tunelab.peft as peft\n"
        "import tunelab.training.loop\n"
        "from tunelab import training\n"
        "from tunelab.training.loop import forward\n"
        "from tunelab.training import _every, build_model\n"
        "from tunelab.errors import ConfigError\n"
        "peft.apply_lora(model)\n"
        "peft.clean_fqn(name)\n"
        "training.sft_backward()\n"
    )
    assert recipe_import_problems(source) == [
        "recipe.py:2: imports tunelab.training.loop, not a public module",
        "recipe.py:4: imports from tunelab.training.loop, not a public module",
        "recipe.py:5: _every is not in tunelab.training.__all__",
        "recipe.py:6: imports from tunelab.errors, not a public module",
        "recipe.py:8: clean_fqn is not in tunelab.peft.__all__",
        "recipe.py:9: sft_backward is not in tunelab.training.__all__",
    ]


def test_recipes_import_only_public_names():
    recipes = builtin_recipes()
    assert len(recipes) >= 4
    problems = [
        problem
        for path in recipes.values()
        for problem in recipe_import_problems(path.read_text(encoding="utf-8"), path.name)
    ]
    assert not problems, "\n".join(problems)


def _documented() -> dict[str, list[str]]:
    """docs/api.md: each ``## `module``` section and the ``- `name```: entries under it."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in API_DOCS.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## `(tunelab[\w.]*)`.*", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
            continue
        entry = re.match(r"- `([\w.]+)`", line)
        if entry and current is not None:
            current.append(entry.group(1))
    return sections


def test_api_docs_have_one_entry_per_public_name():
    documented = _documented()
    assert sorted(documented) == sorted(PUBLIC)
    for module, names in PUBLIC.items():
        missing = sorted(set(names) - set(documented[module]))
        stale = sorted(set(documented[module]) - set(names))
        assert not missing, f"docs/api.md, {module}: no entry for {missing}"
        assert not stale, f"docs/api.md, {module}: {stale} are not in its __all__"
        assert len(documented[module]) == len(set(documented[module])), module
