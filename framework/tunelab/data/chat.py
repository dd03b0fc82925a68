"""Conversations through the tokenizer's chat template: served ids, and labels on assistant turns.

The ids are those of ``transformers``' ``apply_chat_template(messages, tokenize=True)``: the
template's text encoded whole, without adding special tokens (the template writes BOS itself).

What is trained is each assistant turn as the template renders it: its content and its
end-of-turn token(s), never the role header that opens it (at generation time the header is
part of the prompt). The prompt that asks for assistant message ``i`` is
``prompt_i = render(messages[:i], add_generation_prompt=True)``; the turn is what
``render(messages[:i + 1])`` adds after it. Within the turn, the trained characters are:

- the template's ``{% generation %}`` blocks, when it has them (what ``transformers``'
  ``return_assistant_tokens_mask`` uses);
- otherwise everything up to and including the turn's last end-of-turn token (the tokenizer's
  ``stop_ids``); what follows it, like the newline after ChatML's ``<|im_end|>``, is never
  generated and not trained.

A token is trained when it overlaps a trained character span, as in ``transformers``.

Some templates render earlier turns differently once later turns exist: reasoning templates
drop the ``<think>`` blocks of old turns (Qwen3); Mistral's writes the system prompt into the
last user turn only. A whole-conversation sample would then teach turns in a form the model is
never asked to produce. So the conversation is one sample only when, for every trained turn,
``prompt_i`` is a prefix of ``render(messages[:i + 1])`` and that is a prefix of the whole
render. Otherwise each trained turn becomes its own sample: ``prompt_i`` (exactly what the
model is served when asked for that turn) followed by the turn as the template renders it when
it is the last message, with only that turn trained. When ``prompt_i`` is a prefix of
``render(messages[:i + 1])`` that sample is the latter render itself; when it is not (Mistral),
the turn is located in that render by rendering the conversation with a marker as the turn's
content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunelab.config._component_rules import NAMED_TEMPLATES
from tunelab.data.chat_template import (
    REASONING_KEYS,
    ChatTemplate,
    ChatTemplateError,
    normalize_messages,
)
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError

# (token ids, mask) where mask[i] is True for tokens left out of the loss.
TokenizedChat = tuple[list[int], list[bool]]


def chat_template_of(tokenizer: Tokenizer) -> ChatTemplate:
    """Return the tokenizer's own chat template (``template: auto``), compiled.

    Raises:
        ConfigError: If the tokenizer has none; the message names the named formats.
        DataError: If the template does not compile.
    """
    if tokenizer.chat_template is None:
        formats = ", ".join(sorted(NAMED_TEMPLATES))
        raise ConfigError(
            f"template: auto renders with the tokenizer's own chat template, but "
            f"{tokenizer.no_chat_template_reason}. Give the tokenizer one (its chat_template "
            f"argument takes a .jinja file), or, for a base model, name a format: {formats}"
        )
    tokenizer.chat_template.check()
    return tokenizer.chat_template


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    template: ChatTemplate | None = None,
) -> list[int]:
    """Render ``messages`` with the chat template and encode them, as ``transformers`` does.

    Args:
        tokenizer: The tokenizer.
        messages: The conversation: dicts with ``role`` and ``content``, or ``Message``s.
        add_generation_prompt: Open the assistant's reply (what generation feeds the model).
        tools: Tool JSON schemas, or None.
        documents: Documents for retrieval-augmented templates, or None.
        template_kwargs: Extra template variables (``enable_thinking``, ``date_string``, ...).
        template: The template; None for the tokenizer's own.

    Returns:
        The token ids.

    Raises:
        ConfigError: If there is no template.
        DataError: If the template does not compile; ``ChatTemplateError`` if it fails.
    """
    template = template or chat_template_of(tokenizer)
    text = template.render(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        documents=documents,
        template_kwargs=template_kwargs,
    )
    return tokenizer.encode(text, add_bos=False)


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


def _end_of_turn(tokenizer: Tokenizer, text: str, start: int, end: int) -> int:
    """Where turn text ``text[start:end]`` stops being generated: after its last stop token."""
    turn = text[start:end]
    cut = -1
    for token_id in tokenizer.stop_ids:
        token = tokenizer.id_to_token(token_id)
        if token:
            found = turn.rfind(token)
            if found >= 0:
                cut = max(cut, found + len(token))
    return start + cut if cut >= 0 else end


# Stands for an assistant turn's content, to find where the template starts the turn. Private
# use characters: no real content or template text contains them.
_MARKER = "\ue000tunelab-turn\ue001"


def tokenize_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Any],
    *,
    train_on_input: bool = False,
    trained_turns: Sequence[int] | None = None,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    template: ChatTemplate | None = None,
) -> list[TokenizedChat]:
    """Tokenize a conversation with the chat template and mark what is trained.

    Args:
        tokenizer: The tokenizer.
        messages: The conversation: dicts with ``role`` and ``content``, or ``Message``s.
        train_on_input: Train on every token but the first (the first predicts nothing in its
            document, so packed documents never predict each other).
        trained_turns: Indices of the assistant messages to train; None: every assistant
            message. (Preference pairs train only the answer, not assistant turns of the prompt.)
        add_generation_prompt: Let the template open one more assistant reply at the end.
        tools: Tool JSON schemas, or None.
        documents: Documents for retrieval-augmented templates, or None.
        template_kwargs: Extra template variables.
        template: The template; None for the tokenizer's own.

    Returns:
        ``[(ids, mask)]``: one sample, or one per trained turn when the template renders
        earlier turns differently once later ones exist (see the module docstring).
        ``mask[i]`` is True for tokens left out of the loss.

    Raises:
        ConfigError: If there is no template.
        DataError: If the template does not compile.
        ChatTemplateError: If rendering fails, or the turn cannot be told apart in the render.
        ValueError: If ``trained_turns`` names a message that is not an assistant message.
    """
    template = template or chat_template_of(tokenizer)
    messages = normalize_messages(messages)
    if not messages:
        raise ChatTemplateError("empty conversation")
    options = dict(tools=tools, documents=documents, template_kwargs=template_kwargs)

    def render(
        conversation: list[dict[str, Any]], prompt: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        return template.render_with_spans(conversation, add_generation_prompt=prompt, **options)

    full, full_blocks = render(messages, add_generation_prompt)
    if train_on_input:
        ids = tokenizer.encode(full, add_bos=False)
        return [(ids, [i == 0 for i in range(len(ids))])]
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if trained_turns is None:
        trained_turns = assistant
    wrong = sorted(set(trained_turns) - set(assistant))
    if wrong:
        raise ValueError(f"trained_turns {wrong} are not assistant messages")
    turns = []
    for index in sorted(set(trained_turns)):
        prompt = _prompt(render, messages, index)
        if index + 1 == len(messages) and not add_generation_prompt:
            through, blocks = full, full_blocks
        else:
            through, blocks = render(messages[: index + 1], False)
        turns.append((index, prompt, through, blocks))
    if all(
        through.startswith(prompt) and full.startswith(through) for _, prompt, through, _ in turns
    ):
        regions = [(len(prompt), len(through)) for _, prompt, through, _ in turns]
        return [_label(tokenizer, template, full, full_blocks, regions)]
    samples = []
    for index, prompt, through, blocks in turns:
        if through.startswith(prompt):
            text, start = through, len(prompt)
        else:
            head = _turn_head(render, messages, index)
            if not through.startswith(head):
                raise ChatTemplateError(
                    f"message {index}: cannot find the assistant turn in the template's render: "
                    "it starts neither with the prompt for the turn nor as a render with only "
                    "the turn's content changed"
                )
            text, start = prompt + through[len(head) :], len(prompt)
            shift = len(prompt) - len(head)
            blocks = [(low + shift, high + shift) for low, high in blocks if low >= len(head)]
        samples.append(_label(tokenizer, template, text, blocks, [(start, len(text))]))
    return samples


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
    write before the content), so the text before the marker is the conversation as the
    template renders it when this turn is the last one, up to and including the turn's header.

    Raises:
        ChatTemplateError: If the marker does not appear exactly once in the render.
    """
    turn = {k: v for k, v in messages[index].items() if k not in REASONING_KEYS}
    text, _ = render([*messages[:index], {**turn, "content": _MARKER}], False)
    if text.count(_MARKER) != 1:
        raise ChatTemplateError(
            f"message {index}: the template does not render the assistant's content as given, "
            "so the turn cannot be located in its render"
        )
    return text[: text.index(_MARKER)]


def _label(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    text: str,
    blocks: list[tuple[int, int]],
    regions: list[tuple[int, int]],
) -> TokenizedChat:
    """Encode ``text``, training the assistant turns at character ``regions`` only."""
    if template.has_generation_blocks:
        # The template says what is generated; keep the blocks inside trained turns, clipped
        # to the turn (a block that also wrapped the role header would train the prompt).
        spans = [
            (max(start, low), min(end, high))
            for start, end in blocks
            for low, high in regions
            if max(start, low) < min(end, high)
        ]
    else:
        spans = [(low, _end_of_turn(tokenizer, text, low, high)) for low, high in regions]
    return _mask_from_spans(tokenizer, text, spans)
