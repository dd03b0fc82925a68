"""Print the dev extras' libraries pinned at their floors, for `make test-min`.

Each ``"name>=X"`` in the ``dev = [...]`` list of pyproject.toml's optional dependencies becomes
``name==X``, except the tools (pytest, pytest-xdist, ruff, hatchling), whose floors say
nothing about the code.
Read with a regular expression, not tomllib, so it runs on every Python tunelab supports.
"""

import re
import sys
from pathlib import Path

TOOLS = {"pytest", "pytest-xdist", "ruff", "hatchling"}


def floor_pins(pyproject_text: str) -> list[str]:
    """Return ``name==floor`` for every non-tool dev extra with a ``>=`` floor."""
    block = re.search(r"^dev = \[(.*?)^\]", pyproject_text, flags=re.MULTILINE | re.DOTALL)
    if block is None:
        sys.exit("pyproject.toml has no `dev = [` list of optional dependencies")
    pins = []
    for requirement in re.findall(r'"([^"]+)"', block.group(1)):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)", requirement.strip())
        if match is None:
            sys.exit(f"pyproject.toml: dev requirement {requirement!r} has no plain '>=' floor")
        if match.group(1).lower() not in TOOLS:
            pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


if __name__ == "__main__":
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    print(" ".join(floor_pins(pyproject.read_text())))
