"""An Ollama ``Modelfile`` beside a GGUF file: its prompt template and stop tokens.

Ollama's ``TEMPLATE`` is a Go template, not Jinja, so the chat template cannot be copied. It is
derived by rendering the Jinja template (tunelab's sandboxed renderer, as training rendered the
data) on one message per role with a marker as content: what comes before the marker is that
role's prefix, what follows it the suffix; the generation prompt is what
``add_generation_prompt`` adds to an empty conversation. The derived template is accepted only
if rendering a three-turn conversation through it gives exactly the Jinja render; otherwise
(templates that depend on position, e.g. one that puts the system prompt inside the first user
turn) the Modelfile has no ``TEMPLATE`` and Ollama falls back to the chat template inside the
GGUF file, which it matches against the templates it knows.

Stop tokens are the special tokens a turn ends with (``<|eot_id|>``, ``<|im_end|>``) and EOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from tunelab.data.chat_template import ChatTemplate
from tunelab.errors import DataError

__all__ = ["modelfile"]

_MARK = "\x1eTUNELAB-CONTENT\x1e"
_ROLES = ("system", "user", "assistant")
_SPECIAL = re.compile(r"<\|[^|<>]+\|>|<[a-z_]+_of_turn>|</s>")


def _render(template: ChatTemplate, messages: list[dict[str, str]], generate: bool) -> str:
    return template.render(messages, add_generation_prompt=generate)


def _turns(template: ChatTemplate) -> tuple[str, dict[str, tuple[str, str]], str] | None:
    """``(start, {role: (prefix, suffix)}, generation prompt)``, or None if not separable."""
    try:
        start = _render(template, [], False)
        generation = _render(template, [], True).removeprefix(start)
        parts = {}
        for role in _ROLES:
            text = _render(template, [{"role": role, "content": _MARK}], False)
            if not text.startswith(start) or text.count(_MARK) != 1:
                return None
            prefix, suffix = text.removeprefix(start).split(_MARK)
            parts[role] = (prefix, suffix)
    except DataError:
        return None
    return start, parts, generation


def _go_template(start: str, parts: dict[str, tuple[str, str]], generation: str) -> str:
    # No trimming actions ({{- ... }}): the turns' own newlines are part of the prompt.
    def literal(text: str) -> str:
        return text.replace("{{", '{{ "{{" }}')

    branches = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}'
        f"{literal(prefix)}{{{{ .Content }}}}{literal(suffix)}"
        for i, (role, (prefix, suffix)) in enumerate(parts.items())
    )
    return (
        f"{literal(start)}{{{{ range .Messages }}}}{branches}{{{{ end }}}}"
        f"{{{{ end }}}}{literal(generation)}"
    )


def _check(
    template: ChatTemplate, start: str, parts: dict[str, tuple[str, str]], generation: str
) -> bool:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    try:
        expected = _render(template, conversation, True)
    except DataError:
        return False
    ours = start + "".join(
        parts[m["role"]][0] + m["content"] + parts[m["role"]][1] for m in conversation
    )
    return ours + generation == expected


def modelfile(gguf_name: str, template: ChatTemplate | None, stop_tokens: Sequence[str]) -> str:
    """The text of an Ollama ``Modelfile`` for the GGUF file ``gguf_name`` beside it.

    Args:
        gguf_name: The GGUF file's name (``FROM ./{gguf_name}``).
        template: The model's chat template, or None (a base model: no ``TEMPLATE``).
        stop_tokens: Tokens that end a generation (EOS, end-of-turn tokens).

    Returns:
        The Modelfile.
    """
    lines = [f"FROM ./{gguf_name}"]
    stops = list(dict.fromkeys(stop_tokens))
    turns = None if template is None else _turns(template)
    if turns is not None and _check(template, *turns):
        start, parts, generation = turns
        # BOS is added by llama.cpp's tokenizer (tokenizer.ggml.add_bos_token), not the prompt.
        if (
            template.special_tokens.get("bos_token")
            and start == template.special_tokens["bos_token"]
        ):
            start = ""
        lines.append(f'TEMPLATE """{_go_template(start, parts, generation)}"""')
        for _prefix, suffix in parts.values():
            stops += [t for t in _SPECIAL.findall(suffix) if t not in stops]
    lines += [f"PARAMETER stop {json.dumps(token)}" for token in stops]
    return "\n".join(lines) + "\n"
