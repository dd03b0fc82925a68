"""A tokenizer's own ``chat_template``: found as ``transformers`` finds it, rendered as it renders it.

A model is served with the Jinja template in its tokenizer files, so training renders data with
the same template and the same rendering rules as ``transformers``' ``apply_chat_template``:
a sandboxed environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
the ``loopcontrols`` extension), the helpers templates rely on (``raise_exception``,
``strftime_now``, a ``tojson`` filter that keeps non-ASCII text and key order), the special
tokens of the tokenizer config as variables (``bos_token``, ``eos_token``, ...), ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, and any extra keyword arguments.

Templates come from model folders, which tunelab treats as data rather than code (see the
"Trust" section of the design): the sandbox refuses attribute access to Python internals, and
``namespace()`` refuses underscore names, as in ``transformers``.

``{% generation %}...{% endgeneration %}`` blocks mark what the assistant generates; a render
can report their character spans (what ``return_assistant_tokens_mask`` uses).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import jinja2

from tunelab._model_files import read_model_text
from tunelab.data import _render_budget
from tunelab.data._jinja_env import environment, no_tracking, template_line, tracking
from tunelab.errors import CheckpointError, ConfigError, DataError

# The named special tokens a template sees, as transformers' ``special_tokens_map`` lists them.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Variables the renderer sets itself; ``template_kwargs`` may not redefine them.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
# Names a message's reasoning may come under; ``transformers`` copies the first one found to
# ``reasoning_content`` (and to ``thinking`` when unset), so templates reading either work.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_DIR = "additional_chat_templates"


class ChatTemplateError(DataError):
    """A template failed while rendering one conversation (``raise_exception``, a bad value).

    Dataset builders report it as a malformed row; a template that does not compile raises a
    plain ``DataError`` instead, since no row could be rendered with it.
    """


class RenderBudgetError(DataError):
    """A render ran out of its time or size budget: the template's fault, not the row's.

    Not a ``ChatTemplateError``, so no builder takes it for a malformed row: a template that
    overruns its budget on one row would cost every other row its budget too (a 3 s deadline
    on each of 300 rows and each of their prefix renders is hours), so the first overrun ends
    the dataset build, skip_malformed or not.
    """


def _plain(value: Any) -> Any:
    """A copy made of JSON types only, so the template sees no Python object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    for kind in (str, bool, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, kind):
            return kind(value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as the template sees them, as ``transformers`` prepares them.

    Keys whose value is ``None`` are dropped (templates handle a missing key, not a null one),
    and a message's reasoning under any of ``reasoning_content``, ``thinking`` or ``reasoning``
    is also given as ``reasoning_content`` and, unless set, ``thinking``.

    Args:
        messages: Dicts with ``role`` and ``content`` (and any other keys), or ``Message``s.

    Returns:
        Plain dicts.
    """
    result = []
    for message in messages:
        plain = _plain(message)
        if not isinstance(plain, dict):
            raise ChatTemplateError(f"a message must be a mapping, got {type(message).__name__}")
        plain = {key: value for key, value in plain.items() if value is not None}
        plain.pop("masked", None)  # tunelab's Message field, not part of the chat
        reasoning = next((plain[key] for key in REASONING_KEYS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        result.append(plain)
    return result


class ChatTemplate:
    """One Jinja chat template and the special tokens its tokenizer gives it.

    Attributes:
        text: The template source.
        source: Where it came from, for error messages (a file, or a file and key).
        special_tokens: ``bos_token``, ``eos_token``, ... as the template sees them.
    """

    def __init__(
        self, text: str, *, source: str, special_tokens: Mapping[str, str] | None = None
    ) -> None:
        """Hold ``text``; it is compiled on first use (``check`` compiles it now)."""
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Tokenizing workers receive the template pickled; they compile it again themselves
        # (a compiled Jinja template holds the sandboxed environment, which does not pickle).
        state = dict(self.__dict__)
        state.pop("_compiled", None)
        return state

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}`` blocks."""
        return bool(_GENERATION_TAG.search(self.text))

    @functools.cached_property
    def _compiled(self) -> jinja2.Template:
        try:
            # Compiling evaluates constant output (`{{ 'x' * 3 }}`): it has a budget too.
            with _render_budget.budget(self.text):
                return environment().from_string(self.text)
        except jinja2.TemplateSyntaxError as error:
            raise DataError(
                f"chat template {self.source}: line {error.lineno}: {error.message}"
            ) from None
        except _render_budget.RenderBudgetExceeded as error:
            message = str(error) or "compiling took longer than the render budget"
            raise DataError(f"chat template {self.source}: {message}") from None

    def check(self) -> None:
        """Compile the template.

        Raises:
            DataError: If it is not valid Jinja (naming the source and the line).
        """
        self._compiled  # noqa: B018 - compiling is the point

    def join_instruction(self, instruction: str, input: str) -> str:
        """Return the user message for an instruct row (instruction plus optional input)."""
        return f"{instruction}\n\n{input}" if input else instruction

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation to text, as ``apply_chat_template(..., tokenize=False)``.

        Args:
            messages: The conversation (dicts or ``Message``s).
            add_generation_prompt: Let the template open the assistant's reply.
            tools: JSON schemas of the tools the model may call, or None.
            documents: Documents for retrieval-augmented templates, or None.
            template_kwargs: Extra variables (e.g. ``{"enable_thinking": False}``); they win
                over the special tokens of the same name.

        Returns:
            The rendered text.

        Raises:
            DataError: If the template does not compile.
            ChatTemplateError: If rendering fails (``raise_exception`` or any other error).
            RenderBudgetError: If rendering exceeds its time or size budget.
        """
        return self._render(messages, add_generation_prompt, tools, documents, template_kwargs)[0]

    def render_with_spans(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render, and return the ``(start, end)`` character span of each generation block.

        Args and Raises are as for ``render``.

        Returns:
            ``(text, spans)``; ``spans`` is empty when the template has no generation blocks.
        """
        return self._render(
            messages, add_generation_prompt, tools, documents, template_kwargs, track=True
        )

    def _render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        track: bool = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        compiled = self._compiled
        reserved = sorted(set(template_kwargs or {}) & set(RESERVED_VARIABLES))
        if reserved:
            raise ConfigError(
                f"template_kwargs may not set {', '.join(reserved)}: the renderer sets them"
            )
        variables = {
            **self.special_tokens,
            **_plain(dict(template_kwargs or {})),
            "messages": normalize_messages(messages),
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
        }
        rendered: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with (
                _render_budget.budget(variables) as limits,
                tracking(rendered, spans) if track else no_tracking(),
            ):
                size = 0
                for block in compiled.generate(**variables):
                    size += len(block)
                    limits.check_size(size, "the rendered text")
                    rendered.append(block)
        except ChatTemplateError:
            raise
        except _render_budget.RenderBudgetExceeded as error:
            # The template is untrusted code: it may not exhaust the machine.
            message = str(error) or limits.timeout_message()
            raise RenderBudgetError(
                f"chat template {self.source}: {message}; stopped at the first overrun, since "
                "every row renders with this template: fix or replace it"
            ) from None
        except Exception as error:  # The template is untrusted code: any failure is its own.
            line = template_line(error)
            where = f" (line {line})" if line is not None else ""
            message = error.message if isinstance(error, jinja2.TemplateError) else None
            message = message or f"{type(error).__name__}: {error}"
            raise ChatTemplateError(f"chat template {self.source}{where}: {message}") from error
        return "".join(rendered), spans


def _read_text(path: Path, folder: Path | None = None) -> str:
    """A template file's text; one of a tokenizer ``folder`` only through its checked open."""
    try:
        return path.read_text(encoding="utf-8") if folder is None else read_model_text(path, folder)
    except CheckpointError as error:
        raise DataError(str(error)) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the chat template ({error})") from error


def find_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The chat templates a tokenizer folder holds, by name, as ``transformers`` finds them.

    ``chat_template.jinja`` (the ``default``) and ``additional_chat_templates/*.jinja`` take
    priority over ``tokenizer_config.json``'s ``chat_template``, which is a string (the
    ``default``) or a list of ``{"name", "template"}``.

    Args:
        folder: The tokenizer folder.
        config: Its parsed ``tokenizer_config.json`` (empty when there is none).

    Returns:
        Template name to ``(text, source)``; empty when the tokenizer has no template.

    Raises:
        DataError: If ``chat_template`` in the config has an unexpected shape.
    """
    found: dict[str, tuple[str, str]] = {}
    file = folder / _TEMPLATE_FILE
    if file.is_file():
        found["default"] = (_read_text(file, folder), str(file))
    extra = folder / _TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = (_read_text(path, folder), str(path))
    if found:
        return found
    value = config.get("chat_template")
    source = str(folder / "tokenizer_config.json")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, f"{source} (chat_template)")}
    if isinstance(value, list) and all(
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and isinstance(item.get("template"), str)
        for item in value
    ):
        return {
            item["name"]: (item["template"], f"{source} (chat_template {item['name']!r})")
            for item in value
        }
    raise DataError(
        f"{source}: chat_template must be a string or a list of {{name, template}} objects"
    )


def select_chat_template(
    found: Mapping[str, tuple[str, str]],
    choice: str | None,
    special_tokens: Mapping[str, str],
    folder: Path,
) -> tuple[ChatTemplate | None, str]:
    """Pick the template to render with.

    Args:
        found: What ``find_chat_templates`` returned.
        choice: None for the tokenizer's ``default``; otherwise the name of one of its templates,
            the path of a template file, or the template text itself (it holds ``{{`` or ``{%``).
        special_tokens: The special tokens the template sees.
        folder: The tokenizer folder, for messages.

    Returns:
        ``(template, why_none)``: the template, or None and a sentence saying why.

    Raises:
        ConfigError: If ``choice`` is neither a template name, a file, nor template text.
    """
    if choice is None:
        if "default" in found:
            text, source = found["default"]
            return ChatTemplate(text, source=source, special_tokens=special_tokens), ""
        if found:
            names = ", ".join(sorted(found))
            return None, (
                f"{folder} has named chat templates ({names}) but none named 'default': set "
                "the tokenizer's chat_template to one of them"
            )
        return None, (
            f"{folder} has no chat template (no chat_template in tokenizer_config.json, no "
            f"{_TEMPLATE_FILE})"
        )
    if choice in found:
        text, source = found[choice]
        return ChatTemplate(text, source=source, special_tokens=special_tokens), ""
    if "{{" in choice or "{%" in choice:
        return ChatTemplate(
            choice, source="(chat_template text)", special_tokens=special_tokens
        ), ""
    path = Path(choice).expanduser()
    if path.is_file():
        return ChatTemplate(_read_text(path), source=str(path), special_tokens=special_tokens), ""
    names = f"the tokenizer's templates: {', '.join(sorted(found))}" if found else "none named"
    raise ConfigError(
        f"chat_template {choice!r} is not a template name ({names}), an existing file, "
        "or template text"
    )
