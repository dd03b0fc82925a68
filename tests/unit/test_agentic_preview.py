"""``tunelab data preview`` of an agentic config shows what episodes start from: prompts and tools."""

import io

from tunelab import _paths
from tunelab.cli._data import preview


def test_preview_shows_the_tools_and_the_environments_prompt():
    out = io.StringIO()
    environment = "agentic.environments=[{_component_: tunelab.rl.agentic.KeyValueStore}]"
    # The embedded model stands in for tiny/agentic_sft's (preview reads the tokenizer only).
    model = f"model.path={_paths.assets_dir() / 'tiny'}"
    preview("tiny/agentic_grpo", [environment, model], rows=2, as_json=False, out=out)
    text = out.getvalue()
    assert "agentic episodes" in text.splitlines()[0]
    assert text.count("--- episode ") == 2
    assert "tools: calculator, get, set;" in text
    assert "environment KeyValueStore" in text
    # The template shows the tools; reset's task is added to the user's message.
    assert "Tools: calculator(expression)" in text and "get(key) set(key, value)" in text
    assert "Set key total to the value of key" in text
