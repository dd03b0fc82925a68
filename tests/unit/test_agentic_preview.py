"""``tunelab data preview`` of an agentic config shows what episodes start from: prompts and tools."""

import io

from tunelab.cli._data import preview


def test_preview_shows_the_tools_and_the_environments_prompt():
    out = io.StringIO()
    environment = "agentic.environments=[{_component_: tunelab.rl.agentic.KeyValueStore}]"
    preview("tiny/agentic_grpo", [environment], rows=2, as_json=False, out=out)
    text = out.getvalue()
    assert "agentic episodes" in text.splitlines()[0]
    assert text.count("--- episode ") == 2
    assert "tools: reverse_words, sort_letters, next_number, count_words, get, set;" in text
    assert "environment KeyValueStore" in text
    # The template shows the tools; reset's task is added to the user's message.
    assert "Tools: reverse_words(words)" in text and "get(key) set(key, value)" in text
    assert "Set key total to the value of key" in text
