"""The zygote's pieces that run without a launch: what it imports, and the thin client."""

import subprocess
import sys
import textwrap

from tunelab.lifecycle import worker_client
from tunelab.lifecycle.worker_start import WORKER_CODE
from tunelab.lifecycle.zygote import (
    CLIENT_CODE,
    ZYGOTE_ENV,
    recipe_imports,
    zygote_enabled,
)


def test_recipe_imports_are_the_top_level_absolute_ones(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        textwrap.dedent(
            """
            import os, json as j
            from tunelab.lifecycle import recipe_main, worker_start
            from . import sibling
            from helpers import *
            try:
                import yaml
            except ImportError:
                pass

            def main():
                import numpy
            """
        )
    )
    assert recipe_imports(str(recipe)) == [
        "os",
        "json",
        "tunelab.lifecycle",
        "tunelab.lifecycle.recipe_main",
        "tunelab.lifecycle.worker_start",
        "helpers",
        "yaml",
    ]
    recipe.write_text("def broken(:\n")
    assert recipe_imports(str(recipe)) == []
    assert recipe_imports(str(tmp_path / "missing.py")) == []


def test_the_zygote_is_on_unless_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv(ZYGOTE_ENV, raising=False)
    assert zygote_enabled()
    for off in ("0", "false", "off", " no "):
        monkeypatch.setenv(ZYGOTE_ENV, off)
        assert not zygote_enabled()
    monkeypatch.setenv(ZYGOTE_ENV, "1")
    assert zygote_enabled()


def test_the_client_imports_only_the_standard_library():
    code = CLIENT_CODE.replace(
        "m.main(t)", "print(sorted(set(sys.modules) & {'tunelab', 'torch'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}"], capture_output=True, text=True, check=True
    )
    assert result.stdout == "[]\n", result.stderr
    assert worker_client.__file__ in CLIENT_CODE


def test_without_a_zygote_the_client_runs_the_recipe_as_worker_code_does(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        "import gc, sys\nprint(__name__, sys.argv, sys.path[0], gc.get_threshold()[0])\n"
    )
    outputs = []
    for code in (WORKER_CODE, CLIENT_CODE):
        result = subprocess.run(
            [sys.executable, "-u", "-c", code, str(recipe), "--config", "x", "a=1"],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin", worker_client.SOCKET_ENV: str(tmp_path / "none")},
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[1].startswith("__main__ [") and f"'a=1'] {tmp_path} 100000\n" in outputs[1]
