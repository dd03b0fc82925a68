"""An assistant turn as the model is asked for it and generates it, and its labels.

The parts of ``tunelab.data.chat``'s layout rule (see its docstring): the prompt that asks for
a turn, the turn's generated text (up to its last ``{% generation %}`` block, or its first stop
token), where the turn lies when the template writes the prompt differently once the turn
exists (Mistral), and the mask of a render that trains some turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.data.chat_template import REASONING_KEYS, ChatTemplate, ChatTemplateError
from tunelab.data.tokenizer import Tokenizer

# (token ids, mask) where mask[i] is True for tokens left out of the loss.
TokenizedChat = tuple[list[int], list[bool]]


def _mask_from_spans(
    tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]]
) -> tuple[list[int], list[bool]]:
    """Encode ``text``; a token is trained (mask False) when it overlaps one of ``spans``."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    spans = sorted(spans)
    mask = []
    index = 0
    for start, end in offsets:
        # Spans and tokens are both in order: skip the spans this token is already past.
        while index < len(spans) and start >= spans[index][1]:
            index += 1
        mask.append(not (index < len(spans) and end > spans[index][0]))
    return ids, mask


def _generated_end(
    tokenizer: Tokenizer, template: ChatTemplate, text: str, blocks: list, start: int
) -> int:
    """Where the model stops generating a turn that starts at ``text[start]``.

    With ``{% generation %}`` blocks, at the end of the turn's last block; otherwise just after
    the first stop token (``stop_ids``) the turn writes, where generation would stop (Phi-3.5's
    ``<|end|>``, not the EOS its template writes after the last turn); the turn's whole text
    when it writes none.
    """
    if template.has_generation_blocks:
        ends = [high for _, high in blocks if high > start]
        if ends:
            return max(ends)
    cut = len(text)
    for token_id in tokenizer.stop_ids:
        token = tokenizer.id_to_token(token_id)
        if token:
            found = text.find(token, start, cut)
            if found >= 0:
                cut = found + len(token)
    return cut


# Stands for an assistant turn's content, to find where the template starts the turn. Private
# use characters: no real content or template text contains them.
_MARKER = "\ue000tunelab-turn\ue001"


@dataclass
class Turn:
    """An assistant turn as the model is asked for it and generates it.

    ``text`` is the render in which the turn is the last message, starting with ``prompt``
    (what the model is served to produce the turn); ``generated`` follows ``prompt`` in it and
    is what the model writes, up to its end of turn; ``blocks`` are ``text``'s generation
    blocks; ``reasoning`` is the message's reasoning text, if any (to leave it untrained).
    """

    index: int
    prompt: str
    generated: str
    text: str
    blocks: list[tuple[int, int]]
    reasoning: str | None

    def found_in(self, render: str) -> bool:
        """Whether ``render`` shows this turn at its position exactly as it is generated."""
        return render.startswith(self.prompt + self.generated)


def first_difference(turn: Turn, render: str) -> str:
    """Where ``render`` first departs from the turn's prompt and generated text, in words."""
    expected = turn.prompt + turn.generated
    at = next(
        (i for i, (a, b) in enumerate(zip(expected, render)) if a != b),
        min(len(expected), len(render)),
    )
    return (
        f"at character {at}: generated {expected[at : at + 30]!r}, "
        f"the whole render has {render[at : at + 30]!r}"
    )


def make_turn(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    render: Any,
    messages: list[dict[str, Any]],
    index: int,
    through: str,
    blocks: list[tuple[int, int]],
) -> Turn:
    """Assistant turn ``index`` as asked for and generated; ``through`` renders it last.

    When ``prompt`` is a prefix of ``through`` the turn's text is ``through`` itself; when it
    is not (Mistral writes the system prompt into the last user turn only), the turn is found
    in ``through`` by rendering it with a marker as its content, and put after the prompt.

    Raises:
        ChatTemplateError: If the turn cannot be found in ``through``.
    """
    prompt = _prompt(render, messages, index)
    if not through.startswith(prompt):
        head = _turn_head(render, messages, index)
        if not through.startswith(head):
            raise ChatTemplateError(
                f"message {index}: cannot find the assistant turn in the template's render: "
                "it starts neither with the prompt for the turn nor as a render with only "
                "the turn's content changed"
            )
        shift = len(prompt) - len(head)
        blocks = [(low + shift, high + shift) for low, high in blocks if low >= len(head)]
        through = prompt + through[len(head) :]
    end = _generated_end(tokenizer, template, through, blocks, len(prompt))
    reasoning = next((messages[index][k] for k in REASONING_KEYS if k in messages[index]), None)
    return Turn(
        index,
        prompt,
        through[len(prompt) : end],
        through,
        blocks,
        reasoning if isinstance(reasoning, str) and reasoning.strip() else None,
    )


def _prompt(render: Any, messages: list[dict[str, Any]], index: int) -> str:
    """``render(messages[:index], add_generation_prompt=True)``: what asks for turn ``index``."""
    try:
        return render(messages[:index], True)[0]
    except ChatTemplateError as error:
        if index > 0:
            raise
        raise ChatTemplateError(
            "message 0 is an assistant turn, and the template cannot render the empty "
            f"conversation that prompts it ({error})"
        ) from error


def _turn_head(render: Any, messages: list[dict[str, Any]], index: int) -> str:
    """The render of ``messages[:index + 1]`` up to where turn ``index``'s content starts.

    The turn's content is replaced by a marker (and its reasoning dropped, which some templates
    write before the content; a tool-call turn whose template ignores its content becomes a
    plain reply), so the text before the marker is the conversation as the
    template renders it when this turn is the last one, up to and including the turn's header.

    Raises:
        ChatTemplateError: If the marker does not appear exactly once in the render.
    """
    turn = {k: v for k, v in messages[index].items() if k not in REASONING_KEYS}
    text, _ = render([*messages[:index], {**turn, "content": _MARKER}], False)
    if text.count(_MARKER) != 1 and "tool_calls" in turn:
        # A template may render only the calls of a tool-call turn (Mistral): its header is
        # that of a plain reply.
        text, _ = render([*messages[:index], {"role": "assistant", "content": _MARKER}], False)
    if text.count(_MARKER) != 1:
        raise ChatTemplateError(
            f"message {index}: the template does not render the assistant's content as given, "
            "so the turn cannot be located in its render"
        )
    return text[: text.index(_MARKER)]


def label_turns(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    text: str,
    blocks: list[tuple[int, int]],
    turns: list[Turn],
    train_on_reasoning: bool,
) -> TokenizedChat:
    """Encode ``text``, training the given turns (each at its position) only.

    A turn's trained characters are its generated text; with generation blocks, the blocks
    inside it (a block that also wrapped the role header would train the prompt). Without
    ``train_on_reasoning``, the turn's reasoning text, where the render shows it, is not.
    """
    regions = [(len(turn.prompt), len(turn.prompt) + len(turn.generated)) for turn in turns]
    if template.has_generation_blocks:
        spans = [
            (max(start, low), min(end, high))
            for start, end in blocks
            for low, high in regions
            if max(start, low) < min(end, high)
        ]
    else:
        spans = regions
    if not train_on_reasoning:
        holes = []
        for turn, (low, high) in zip(turns, regions):
            found = text.find(turn.reasoning, low, high) if turn.reasoning else -1
            if found >= 0:
                holes.append((found, found + len(turn.reasoning)))
        spans = _without(spans, holes)
    return _mask_from_spans(tokenizer, text, spans)


def _without(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` minus the characters of ``holes``."""
    for hole_start, hole_end in holes:
        kept = []
        for start, end in spans:
            if start < hole_start:
                kept.append((start, min(end, hole_start)))
            if end > hole_end:
                kept.append((max(start, hole_end), end))
        spans = kept
    return spans
