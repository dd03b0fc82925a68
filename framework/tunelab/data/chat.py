"""Conversations through the tokenizer's chat template: served ids, and labels on assistant turns.

The ids are those of ``transformers``' ``apply_chat_template(messages, tokenize=True)``: the
template's text encoded whole, without adding special tokens (the template writes BOS itself).

What is trained is each assistant turn as the model generates it: its content (and tool calls,
and reasoning unless ``train_on_reasoning`` is off) up to its end of turn, never the role header
that opens it (at generation time the header is part of the prompt) and never a tool result,
system or user message. The prompt that asks for assistant message ``k`` is
``prompt_k = render(messages[:k], add_generation_prompt=True)``; the turn's generated text is
what ``render(messages[:k + 1])`` adds after it, up to where generation stops:

- the end of the turn's last ``{% generation %}`` block, when the template has them (and then
  only the blocks are trained: what ``transformers``' ``return_assistant_tokens_mask`` uses);
- otherwise just after the first end-of-turn token (the tokenizer's ``stop_ids``) it writes;
  what follows, like the newline after ChatML's ``<|im_end|>`` or the EOS Phi-3.5 writes after
  the last ``<|end|>``, is never generated and not trained.

A token is trained when it overlaps a trained character span, as in ``transformers``.

One conversation is one sample whenever the whole render shows every assistant turn as the
model generates it: ``prompt_k`` followed by turn ``k``'s generated text is a prefix of the
whole render, for every ``k``. Some templates render earlier turns differently once later turns
exist: reasoning templates drop the ``<think>`` blocks of old turns (Qwen3); Mistral's writes
the system prompt into the last user turn only. Training those turns on the whole render would
teach a form the model is never asked to produce, so they are trained elsewhere: greedily from
the end, the whole render trains the turns it shows as generated, and each remaining turn is
trained in the render that ends with it (``prompt_k`` then the turn, as the template renders it
when it is the last message), together with the earlier turns that render shows as generated.
Every turn is trained exactly once. When ``prompt_k`` is not a prefix of
``render(messages[:k + 1])`` (Mistral), the turn is located in that render by rendering the
conversation with a marker as the turn's content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunelab.config._component_rules import NAMED_TEMPLATES
from tunelab.data._chat_turns import TokenizedChat, first_difference, label_turns, make_turn
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError, normalize_messages
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError


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


@dataclass
class ConversationLayout:
    """How a conversation becomes samples, and why.

    Attributes:
        samples: ``[(ids, mask)]``, in conversation order.
        reason: One sentence: why one sample, or which turn forced a split.
    """

    samples: list[TokenizedChat]
    reason: str


def tokenize_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Any],
    *,
    train_on_input: bool = False,
    train_on_reasoning: bool = True,
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
        messages: The conversation: dicts with ``role`` and ``content`` (and ``tool_calls``,
            ``reasoning_content``, ...), or ``Message``s.
        train_on_input: Train on every token but the first (the first predicts nothing in its
            document, so packed documents never predict each other).
        train_on_reasoning: Train on the reasoning text of assistant turns (``reasoning_content``
            / ``thinking``) where the template renders it; False leaves it as context only.
        trained_turns: Indices of the assistant messages to train; None: every assistant
            message. (Preference pairs train only the answer, not assistant turns of the prompt.)
        add_generation_prompt: Let the template open one more assistant reply at the end.
        tools: Tool JSON schemas, or None.
        documents: Documents for retrieval-augmented templates, or None.
        template_kwargs: Extra template variables.
        template: The template; None for the tokenizer's own.

    Returns:
        ``[(ids, mask)]``: one sample, or more when the whole render shows an earlier assistant
        turn differently from how the model generates it (see the module docstring).
        ``mask[i]`` is True for tokens left out of the loss.

    Raises:
        ConfigError: If there is no template.
        DataError: If the template does not compile.
        ChatTemplateError: If rendering fails, or the turn cannot be told apart in the render.
        ValueError: If ``trained_turns`` names a message that is not an assistant message.
    """
    return conversation_layout(
        tokenizer,
        messages,
        train_on_input=train_on_input,
        train_on_reasoning=train_on_reasoning,
        trained_turns=trained_turns,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        documents=documents,
        template_kwargs=template_kwargs,
        template=template,
    ).samples


def conversation_layout(
    tokenizer: Tokenizer,
    messages: Sequence[Any],
    *,
    train_on_input: bool = False,
    train_on_reasoning: bool = True,
    trained_turns: Sequence[int] | None = None,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    template: ChatTemplate | None = None,
) -> ConversationLayout:
    """``tokenize_conversation``'s samples, with the reason for one sample or a split.

    Args and Raises are as for ``tokenize_conversation``.

    Returns:
        The samples and the reason.
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
        return ConversationLayout(
            [(ids, [i == 0 for i in range(len(ids))])], "train_on_input: the whole render"
        )
    assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if trained_turns is None:
        trained_turns = assistant
    wrong = sorted(set(trained_turns) - set(assistant))
    if wrong:
        raise ValueError(f"trained_turns {wrong} are not assistant messages")
    turns = []
    for index in sorted(set(trained_turns)):
        last = index + 1 == len(messages) and not add_generation_prompt
        through = (full, full_blocks) if last else render(messages[: index + 1], False)
        turns.append(make_turn(tokenizer, template, render, messages, index, *through))
    # Greedily from the end: the whole render trains every turn it shows as generated; each
    # turn it shows otherwise is trained in the render that ends with it (which also trains
    # the earlier turns shown there as generated), so every turn is trained exactly once.
    samples: list[TokenizedChat] = []
    pending = turns
    text, blocks = full, full_blocks
    first_split = next((turn for turn in turns if not turn.found_in(full)), None)
    whole = True
    while pending:
        shown = [turn for turn in pending if turn.found_in(text)]
        # A turn's own render shows it as generated (it is built so): every pass after the
        # whole render trains at least that turn, so the loop ends.
        assert shown or whole, "a turn's own render must show it"
        whole = False
        if shown:
            samples.append(
                label_turns(tokenizer, template, text, blocks, shown, train_on_reasoning)
            )
        done = {turn.index for turn in shown}
        pending = [turn for turn in pending if turn.index not in done]
        if pending:
            text, blocks = pending[-1].text, pending[-1].blocks
    samples.reverse()
    if not turns:  # nothing to train (a prompt): the whole render, all masked
        samples = [label_turns(tokenizer, template, full, full_blocks, [], train_on_reasoning)]
    if first_split is None:
        reason = "one sample: the whole render shows every assistant turn as the model generates it"
    else:
        reason = (
            f"{len(samples)} samples: the whole render shows assistant message "
            f"{first_split.index} differently from how the model generates it "
            f"({first_difference(first_split, full)})"
        )
    return ConversationLayout(samples, reason)


# A conversation that shows how a template lays out conversations: two user turns, each
# answered with reasoning, and a system prompt (some templates refuse one: then none).
_PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Next number after 40:"},
    {"role": "assistant", "content": "41", "reasoning_content": "40 + 1"},
    {"role": "user", "content": "Next number after 41:"},
    {"role": "assistant", "content": "42", "reasoning_content": "41 + 1"},
]


def describe_layout(tokenizer: Tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """One line: whether the tokenizer's chat template makes a conversation one sample, and why.

    A two-turn conversation with a system prompt and reasoning is laid out as
    ``tokenize_conversation`` lays out data (``conversation_layout``'s reason).

    Args:
        tokenizer: The tokenizer (with a chat template).
        template_kwargs: The dataset's extra template variables.

    Returns:
        ``"chat template <source>: <reason>"``.
    """
    template = chat_template_of(tokenizer)
    reason = ""
    for probe in (_PROBE, _PROBE[1:]):
        try:
            layout = conversation_layout(
                tokenizer, probe, template_kwargs=template_kwargs, template=template
            )
        except ChatTemplateError as error:
            reason = f"a two-turn conversation could not be laid out ({error})"
            continue
        reason = layout.reason
        break
    return f"chat template {template.source}: a two-turn conversation is {reason}"
