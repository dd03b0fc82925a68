"""Chat templates cannot exhaust the machine: every render has a time and a size budget.

Each bomb hung, allocated gigabytes or ended in a traceback before (issue 23, finding 9); now
each stops within a few seconds with one ``DataError`` line naming the template.
"""

import json
import threading
import time

import pytest

from tunelab.data import _render_budget
from tunelab.data.chat_template import ChatTemplate
from tunelab.errors import DataError

MESSAGES = [{"role": "user", "content": "hi"}]
# Stopped by the deadline (loops with no hook in their body, long pure-Python helpers).
SLOW = {
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10**6) }}",
    "sorting in a loop": "{% for i in range(99999) %}{% set x = range(99999)|list|sort %}{% endfor %}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
    "{% endmacro %}{{ f(40) }}",
}
# Stopped by the size budget, before the allocation.
LARGE = {
    "tojson indent": "{{ messages|tojson(indent=10**9) }}",
    "starred format width": "{{ '%*d'|format(10**9, 1) }}",
    "format width": "{{ '%0999999999d'|format(1) }}",
    "percent width": "{% set w = 1 %}{{ '%0999999999d' % w }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "str.format nested width": "{{ '{:>{}}'.format(1, 10**9) }}",
    "string repetition": "{{ 'a' * 10**9 }}",
    "list repetition": "{{ ([1] * 10**9)|length }}",
    "range": "{{ range(10**9)|list|length }}",
    "center": "{{ 'a'.center(10**9) }}",
    "doubling in a namespace": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling through a macro": "{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s|length }}"
    "{% endmacro %}{{ d('ab', 40) }}",
    "replace": "{% set s = 'a' * 100000 %}{{ s.replace('a', s)|length }}",
    "join": "{{ range(100000)|join('x' * 100000)|length }}",
    "indent with a string": "{% set s = 'a\n' * 400000 %}{{ s|indent('x' * 1000) }}",
    "output": "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
    # Small to build through shared references, gigantic as text.
    "printed shared references": "{% set l = range(100000)|list %}{{ [l] * 100000 }}",
    "a dict of shared lists": "{% set l = range(100000)|list %}"
    "{{ dict.fromkeys(range(100000), l) }}",
    "a string of shared lists": "{% set l = range(100000)|list %}"
    "{{ dict.fromkeys(range(100000), l)|string|length }}",
    "a concatenation of shared lists": "{% set l = range(100000)|list %}"
    "{{ ('a' ~ dict.fromkeys(range(100000), l))|length }}",
    "a format of shared lists": "{% set l = range(100000)|list %}"
    "{{ '{}'.format(dict.fromkeys(range(100000), l))|length }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "batch": "{{ range(10)|batch(10**9)|list }}",
    "replace of the empty string": "{{ ('x' * 1000)|replace('', 'y' * 10000) }}",
}


def _render(text: str, name: str) -> str:
    return ChatTemplate(text, source=f"<{name}>").render(MESSAGES)


@pytest.mark.parametrize("name", sorted(SLOW))
def test_a_slow_template_is_stopped_at_the_deadline_with_one_line(name):
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        _render(SLOW[name], name)
    elapsed = time.monotonic() - start
    assert elapsed < _render_budget.RENDER_SECONDS + 30, elapsed  # it used to run for hours
    message = str(error.value)
    assert message.startswith(f"chat template <{name}>") and "\n" not in message, message
    assert "render budget" in message, message


@pytest.mark.parametrize("name", sorted(LARGE))
def test_a_large_template_result_is_refused_before_it_is_allocated(name):
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        _render(LARGE[name], name)
    message = str(error.value)
    assert message.startswith(f"chat template <{name}>") and "\n" not in message, message
    # Refused by the size check, before the allocation: not by the deadline.
    assert "exceeds the render budget" in message, message
    assert time.monotonic() - start < _render_budget.RENDER_SECONDS + 30, message


def test_the_budget_grows_with_the_input_and_ordinary_templates_render_unchanged():
    template = ChatTemplate(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{{ '%5d'|format(3) }}{{ '{:>4}'.format(7) }}{{ messages[:1]|tojson(indent=2) }}"
        "{{ dict(ts=1700000000).ts }}{{ 'a,b'.replace(',', ', ') }}{{ ['x', 'y']|join(', ') }}",
        source="ordinary",
    )
    long = "word " * 400_000  # 2M characters: more than the fixed part of the budget
    text = template.render(
        [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]
    )
    assert (
        text.startswith("<|user|>word word") and text.count("word") == 800_000
    )  # content and tojson
    assert text.endswith('    3   7[\n  {\n    "role": "user",\n    "content": "' + long + '"\n  }\n]'
                         "1700000000a, bx, y")  # fmt: skip


def test_a_stop_never_outlives_its_render():
    # Many renders that end just before the watchdog would stop them: none of them, and
    # nothing after them, may see the stop.
    template = ChatTemplate("{% for i in range(2000) %}{{ i }}{% endfor %}", source="quick")
    original = _render_budget.RENDER_SECONDS
    _render_budget.RENDER_SECONDS = 0.0
    try:
        for _ in range(20):
            with pytest.raises(DataError):
                template.render(MESSAGES)
    finally:
        _render_budget.RENDER_SECONDS = original
    time.sleep(3 * _render_budget._WATCH_INTERVAL_S)
    assert template.render(MESSAGES).startswith("012")


def test_renders_in_threads_each_have_their_own_budget():
    results: dict[str, object] = {}

    def render(name: str, text: str) -> None:
        try:
            results[name] = _render(text, name)
        except DataError as error:
            results[name] = error

    slow = threading.Thread(target=render, args=("slow", SLOW["nested loops"]))
    slow.start()
    quick = [
        threading.Thread(target=render, args=(f"quick{i}", "{{ messages[0].content }}"))
        for i in range(4)
    ]
    for thread in quick:
        thread.start()
    for thread in [*quick, slow]:
        thread.join(timeout=120)
    assert isinstance(results["slow"], DataError)
    assert all(results[f"quick{i}"] == "hi" for i in range(4)), results


@pytest.mark.parametrize("bomb", ["nested loops", "string repetition"])
def test_the_first_overrun_stops_the_dataset_build_with_one_line(tmp_path, monkeypatch, bomb):
    # Issue 38, finding 8: each render stopped at its budget, but the build went on to the
    # next row and the next prefix render (300 rows: more than 30 min). The overrun is the
    # template's fault, so the first one ends the build.
    from tunelab._paths import assets_dir
    from tunelab.data import chat_dataset, load_tokenizer, prompt_dataset

    monkeypatch.setattr(_render_budget, "RENDER_SECONDS", 0.2)
    template = tmp_path / "bomb.jinja"
    template.write_text(SLOW.get(bomb) or LARGE[bomb])
    tokenizer = load_tokenizer(assets_dir() / "tiny", chat_template=str(template))
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(200)))
    overruns = []
    original = ChatTemplate._render

    def counted(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except DataError:
            overruns.append(1)
            raise

    monkeypatch.setattr(ChatTemplate, "_render", counted)
    start = time.monotonic()
    for skip_malformed in (False, True):  # not a malformed row: never skipped either
        with pytest.raises(DataError) as error:
            chat_dataset(
                tokenizer,
                source=str(data),
                cache_dir=str(tmp_path / "cache"),
                skip_malformed=skip_malformed,
            )
        message = str(error.value)
        assert message.startswith(f"chat template {template}:") and "\n" not in message, message
        assert "render budget" in message and "row" not in message.split(":")[0], message
    # GRPO's prompts, rendered by every rank itself, stop at the first overrun too.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "hi"}) + "\n" for _ in range(200)))
    with pytest.raises(DataError) as error:
        prompt_dataset(tokenizer, source=str(prompts), skip_malformed=True)
    assert str(error.value).startswith(f"chat template {template}:"), error.value
    assert len(overruns) == 3, overruns  # one render each: 200 rows x 2 renders before
    # 200 rows x 2 renders x 0.2 s took 80 s before.
    assert time.monotonic() - start < 40
