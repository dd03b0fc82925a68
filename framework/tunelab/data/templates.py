r"""Chat and instruct templates: messages to token ids, with the mask of prompt tokens.

``auto`` is the tokenizer's own Jinja chat template (``tunelab.data.chat``): the format the
model is served with, and the one to train instruct models on. The named formats below are
for base models, which have no format of their own yet.

A named template renders each message as pieces: fixed text, special tokens, and the message's
content. Runs of text between special tokens are tokenized whole, as ``transformers``'
``apply_chat_template`` does, so the ids equal the ones a model saw in its own chat format;
each token then takes the mask of its last character. Role headers (``<|start_header_id|>user
<|end_header_id|>\n\n``, ``<|im_start|>assistant\n``, ``### Response:\n``) are always
masked: they are the prompt the model is given at generation time. A message's content and its
end-of-turn token are masked when ``message.masked`` is true.
"""

import difflib
from dataclasses import dataclass

from tunelab.config._component_rules import AUTO_TEMPLATE, NAMED_TEMPLATES
from tunelab.data.chat import chat_template_of, tokenize_conversation
from tunelab.data.chat_template import ChatTemplate
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError, DataError

ROLES = ("system", "user", "assistant")
# The template name that means "the tokenizer's own chat template".
AUTO = AUTO_TEMPLATE


@dataclass(frozen=True)
class Message:
    """One chat turn.

    Attributes:
        role: ``"system"``, ``"user"`` or ``"assistant"``.
        content: The text.
        masked: Exclude the content (and its end-of-turn token) from the loss.
    """

    role: str
    content: str
    masked: bool = False


# A piece is (text or special-token id, masked).
_Piece = tuple[str | int, bool]


class Template:
    """How messages become text and special tokens. Subclasses define one chat format."""

    name = ""

    def start(self, tokenizer: Tokenizer) -> list[_Piece]:
        """Pieces before the first message (e.g. BOS)."""
        return []

    def turn(self, tokenizer: Tokenizer, message: Message) -> list[_Piece]:
        """Pieces for one message."""
        raise NotImplementedError

    def generation_prompt(self, tokenizer: Tokenizer) -> list[_Piece]:
        """Pieces that open the assistant's reply, for generation."""
        raise NotImplementedError

    def join_instruction(self, instruction: str, input: str) -> str:
        """Return the user message for an instruct row (instruction plus optional input)."""
        return f"{instruction}\n\n{input}" if input else instruction

    def special(self, tokenizer: Tokenizer, token: str) -> int:
        """Return the id of the special token ``token``.

        Raises:
            DataError: If the tokenizer does not have it.
        """
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise DataError(
                f"template {self.name!r} needs the special token {token!r}, which the "
                "tokenizer does not have; choose another template"
            )
        return token_id


class Llama3Template(Template):
    r"""Llama 3: ``<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>``."""

    def start(self, tokenizer: Tokenizer) -> list[_Piece]:  # noqa: D102
        return [(self.special(tokenizer, "<|begin_of_text|>"), True)]

    def _header(self, tokenizer: Tokenizer, role: str) -> list[_Piece]:
        return [
            (self.special(tokenizer, "<|start_header_id|>"), True),
            (role, True),
            (self.special(tokenizer, "<|end_header_id|>"), True),
            ("\n\n", True),
        ]

    def turn(self, tokenizer: Tokenizer, message: Message) -> list[_Piece]:  # noqa: D102
        return self._header(tokenizer, message.role) + [
            (message.content, message.masked),
            (self.special(tokenizer, "<|eot_id|>"), message.masked),
        ]

    def generation_prompt(self, tokenizer: Tokenizer) -> list[_Piece]:  # noqa: D102
        return self._header(tokenizer, "assistant")


class ChatMLTemplate(Template):
    r"""ChatML (Qwen): ``<|im_start|>role\ncontent<|im_end|>\n``, no BOS."""

    def turn(self, tokenizer: Tokenizer, message: Message) -> list[_Piece]:  # noqa: D102
        return [
            (self.special(tokenizer, "<|im_start|>"), True),
            (f"{message.role}\n", True),
            (message.content, message.masked),
            (self.special(tokenizer, "<|im_end|>"), message.masked),
            ("\n", True),  # after the stop token: never generated, never trained
        ]

    def generation_prompt(self, tokenizer: Tokenizer) -> list[_Piece]:  # noqa: D102
        return [(self.special(tokenizer, "<|im_start|>"), True), ("assistant\n", True)]


class InstructTemplate(Template):
    r"""Alpaca-like plain text: ``### Instruction:\n...\n\n### Response:\n`` answer, then EOS.

    An instruct row with an input renders as ``### Instruction:\n{instruction}\n\n### Input:
    \n{input}\n\n### Response:\n{output}<eos>``; a system message is plain text before it.
    """

    def start(self, tokenizer: Tokenizer) -> list[_Piece]:  # noqa: D102
        return [(tokenizer.bos_id, True)] if tokenizer.add_bos_token else []

    def turn(self, tokenizer: Tokenizer, message: Message) -> list[_Piece]:  # noqa: D102
        if message.role == "assistant":
            return [
                ("### Response:\n", True),
                (message.content, message.masked),
                (tokenizer.eos_id, message.masked),
            ]
        if message.role == "user":
            return [
                ("### Instruction:\n", True),
                (message.content, message.masked),
                ("\n\n", True),
            ]
        return [(message.content, message.masked), ("\n\n", True)]

    def generation_prompt(self, tokenizer: Tokenizer) -> list[_Piece]:  # noqa: D102
        return [("### Response:\n", True)]

    def join_instruction(self, instruction: str, input: str) -> str:  # noqa: D102
        return f"{instruction}\n\n### Input:\n{input}" if input else instruction


class AlpacaTemplate(InstructTemplate):
    r"""Alpaca: the ``instruct`` format after Alpaca's preamble.

    ``Below is an instruction that describes a task[, paired with an input that provides further
    context]. Write a response that appropriately completes the request.\n\n`` comes first,
    the bracketed part when the row has an input; it is always masked.
    """

    _PREAMBLE = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n"
    )
    _PREAMBLE_WITH_INPUT = (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
    )

    def turn(self, tokenizer: Tokenizer, message: Message) -> list[_Piece]:  # noqa: D102
        pieces = super().turn(tokenizer, message)
        if message.role != "user":
            return pieces
        # join_instruction wrote the input block; the preamble announces it.
        with_input = "\n\n### Input:\n" in message.content
        return [(self._PREAMBLE_WITH_INPUT if with_input else self._PREAMBLE, True), *pieces]


def _named(name: str, template: Template) -> Template:
    template.name = name
    return template


# The names are config's NAMED_TEMPLATES (settings check them without importing this module).
TEMPLATES: dict[str, Template] = {
    name: _named(name, template)
    for name, template in zip(
        NAMED_TEMPLATES,
        (InstructTemplate(), AlpacaTemplate(), Llama3Template(), ChatMLTemplate()),
        strict=True,
    )
}


def get_template(
    template: str | Template | ChatTemplate, tokenizer: Tokenizer | None = None
) -> Template | ChatTemplate:
    """Return the template ``template`` names.

    Args:
        template: ``auto`` (the tokenizer's own chat template), a named format (``alpaca``,
            ``chatml``, ``instruct``, ``llama3``), or a template instance (returned as is).
        tokenizer: The tokenizer; needed for ``auto``.

    Returns:
        A named ``Template``, or the tokenizer's ``ChatTemplate``.

    Raises:
        ConfigError: If no template has that name (the message names the closest one), or
            ``auto`` is asked of a tokenizer without a chat template.
        DataError: If the tokenizer's chat template does not compile.
    """
    if isinstance(template, (Template, ChatTemplate)):
        return template
    if template == AUTO:
        if tokenizer is None:
            raise ConfigError("template 'auto' needs the tokenizer whose chat template it uses")
        return chat_template_of(tokenizer)
    if template not in TEMPLATES:
        known = [AUTO, *sorted(TEMPLATES)]
        close = difflib.get_close_matches(str(template), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown template {template!r} (known: {', '.join(known)}){hint}")
    return TEMPLATES[template]


def _tokenize_pieces(tokenizer: Tokenizer, pieces: list[_Piece]) -> tuple[list[int], list[bool]]:
    tokens: list[int] = []
    mask: list[bool] = []
    text, char_mask = "", []

    def flush() -> None:
        nonlocal text, char_mask
        if text:
            ids, offsets = tokenizer.encode_with_offsets(text)
            for token_id, (start, end) in zip(ids, offsets, strict=True):
                # The last character decides: " yes" after a masked "Answer:" is trained.
                tokens.append(token_id)
                mask.append(char_mask[max(end, start + 1) - 1])
        text, char_mask = "", []

    for value, masked in pieces:
        if isinstance(value, int):
            flush()
            tokens.append(value)
            mask.append(masked)
        else:
            text += value
            char_mask += [masked] * len(value)
    flush()
    return tokens, mask


def tokenize_messages(
    tokenizer: Tokenizer,
    messages: list[Message],
    template: str | Template | ChatTemplate,
    *,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[bool]]:
    """Render ``messages`` with ``template`` and tokenize them.

    With ``auto`` (or a ``ChatTemplate``) the ids are those of ``transformers``'
    ``apply_chat_template``, and the unmasked assistant messages are trained as the template
    renders them (``tunelab.data.chat``); other roles are always masked.

    Args:
        tokenizer: The tokenizer.
        messages: The conversation, in order.
        template: ``auto``, a named format (``alpaca``, ``chatml``, ``instruct``, ``llama3``),
            or a template instance.
        add_generation_prompt: Append the assistant header, ready for the model's reply
            (for generation; the added tokens are masked).

    Returns:
        ``(tokens, mask)``: the ids, and for each id whether it is excluded from the loss.

    Raises:
        ConfigError: If the template name is unknown, or ``auto`` finds no chat template.
        DataError: If the tokenizer lacks a special token the template needs, or the chat
            template fails on these messages (also when it re-renders earlier turns once later
            ones exist, so the conversation is not one sample: use ``tokenize_conversation``).
    """
    chosen = get_template(template, tokenizer)
    if isinstance(chosen, ChatTemplate):
        trained = [i for i, m in enumerate(messages) if m.role == "assistant" and not m.masked]
        samples = tokenize_conversation(
            tokenizer,
            messages,
            trained_turns=trained,
            add_generation_prompt=add_generation_prompt,
            template=chosen,
        )
        if len(samples) != 1:
            raise DataError(
                f"chat template {chosen.source} renders earlier turns differently once later "
                "ones exist, so these messages are one sample per assistant turn: use "
                "tunelab.data.tokenize_conversation"
            )
        return samples[0]
    pieces = chosen.start(tokenizer)
    for message in messages:
        pieces += chosen.turn(tokenizer, message)
    if add_generation_prompt:
        pieces += chosen.generation_prompt(tokenizer)
    return _tokenize_pieces(tokenizer, pieces)
