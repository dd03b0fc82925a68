"""A tokenizer over a Hugging Face ``tokenizer.json``, with BOS/EOS/pad from its config files.

The ``tokenizers`` library does the encoding; this wrapper adds what fine-tuning needs and
``tokenizer.json`` alone does not say: which tokens are BOS, EOS and padding, whether BOS is
added, which ids end a generation, and the model's chat template. Those come from
``tokenizer_config.json`` (which wins), ``special_tokens_map.json`` and ``chat_template.jinja``,
as ``transformers`` reads them.
"""

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from tunelab._model_files import read_model_text
from tunelab.data.chat_template import (
    SPECIAL_TOKEN_KEYS,
    ChatTemplate,
    find_chat_templates,
    select_chat_template,
)
from tunelab.errors import CheckpointError, ConfigError, DataError

# End-of-turn tokens of common chat formats; generation stops at any of them when present, and
# chat-template training stops an assistant turn's labels after them.
_END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<end_of_turn>",
)


class Tokenizer:
    """Encode and decode text; knows the special-token ids that data and generation need.

    Encoding never runs the ``tokenizer.json`` post-processor (which may add BOS on its own):
    BOS and EOS are added here, explicitly, so templates control every special token.

    Attributes:
        bos_id: Id of the beginning-of-sequence token, or ``None`` (e.g. Qwen has none).
        eos_id: Id of the end-of-sequence token.
        pad_id: Id used for padding: the pad token, or ``eos_id`` when there is none.
        add_bos_token: Whether ``encode`` adds BOS by default (``add_bos_token`` in the config).
        max_seq_len: Default maximum sequence length for datasets built with this tokenizer.
        stop_ids: Ids that end a generation: EOS, end-of-turn tokens present in the vocabulary,
            and any ``eos_token_id`` of ``generation_config.json``.
        chat_template: The model's own chat template (``template: auto``), or None.
        chat_template_overridden: Whether ``chat_template`` differs from the template the
            tokenizer folder serves by default (``load_tokenizer``'s ``chat_template`` chose
            another one); an export must then carry it (``extra_files``).
    """

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token (bounds the text a token can cover)."""
        return max((len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)),
                   default=1)  # fmt: skip

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str,
        pad_token: str | None = None,
        add_bos_token: bool = True,
        max_seq_len: int | None = None,
        extra_stop_ids: tuple[int, ...] = (),
        source: str = "tokenizer.json",
        chat_template: ChatTemplate | None = None,
        no_chat_template_reason: str = "",
        chat_template_overridden: bool = False,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``.

        Args:
            tokenizer: The loaded ``tokenizers.Tokenizer``.
            bos_token: BOS token text, or ``None`` when the model has no BOS.
            eos_token: EOS token text.
            pad_token: Padding token text; ``None`` pads with EOS.
            add_bos_token: Whether ``encode`` adds BOS.
            max_seq_len: Default maximum sequence length for datasets.
            extra_stop_ids: More ids that end a generation.
            source: Where the tokenizer came from, for error messages.
            chat_template: The chat template ``template: auto`` renders with.
            no_chat_template_reason: Without a chat template, a sentence saying why (for the
                error of ``template: auto``).
            chat_template_overridden: ``chat_template`` is not the folder's default template.

        Raises:
            DataError: If a named special token is not in the vocabulary.
        """
        # A copy without the post-processor: ids are unchanged, offsets stay untrimmed.
        self._tokenizer = _HFTokenizer.from_str(tokenizer.to_str())
        self._tokenizer.post_processor = None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._source = source
        self.bos_id = self._require(bos_token, "bos_token") if bos_token is not None else None
        self.eos_id = self._require(eos_token, "eos_token")
        self.pad_id = (
            self._require(pad_token, "pad_token") if pad_token is not None else self.eos_id
        )
        self.add_bos_token = add_bos_token and self.bos_id is not None
        self.max_seq_len = max_seq_len
        stops = [self.eos_id]
        stops += [i for i in map(self.token_to_id, _END_OF_TURN_TOKENS) if i is not None]
        stops += list(extra_stop_ids)
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self.chat_template = chat_template
        self.no_chat_template_reason = no_chat_template_reason or f"{source} has no chat template"
        self.chat_template_overridden = chat_template_overridden and chat_template is not None

    @property
    def source(self) -> str:
        """Where the tokenizer came from (its ``tokenizer.json``)."""
        return self._source

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens: BOS, EOS, padding, stop ids and added special tokens."""
        ids = {self.eos_id, self.pad_id, *self.stop_ids}
        ids |= {i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        return frozenset(ids | ({self.bos_id} if self.bos_id is not None else set()))

    @functools.cached_property
    def unfit_ids(self) -> frozenset[int]:
        """The unknown token and a padding token that is not EOS or a stop token.

        Most of the data becoming them means the tokenizer does not fit it (``check_tokens_fit``).
        """
        ids = set()
        unknown = getattr(self._tokenizer.model, "unk_token", None)
        if isinstance(unknown, str) and self.token_to_id(unknown) is not None:
            ids.add(self.token_to_id(unknown))
        if self.pad_id not in self.stop_ids and self.pad_id != self.bos_id:
            ids.add(self.pad_id)
        return frozenset(ids)

    def _require(self, token: str, key: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise DataError(f"{self._source}: {key} {token!r} is not in the vocabulary")
        return token_id

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides the ids and labels built with this tokenizer.

        The vocabulary, merges, normalizer and pre-tokenizer (the serialized
        ``tokenizer.json``), the special-token ids, whether BOS is added, the stop ids (they end
        trained turns) and the chat template with the special tokens it sees. Dataset caches
        are keyed by it, so a changed tokenizer file never reuses another's tokens.
        """
        template = self.chat_template
        state = {
            "tokenizer_json": hashlib.sha256(self._tokenizer.to_str().encode()).hexdigest(),
            "ids": [self.bos_id, self.eos_id, self.pad_id, self.add_bos_token, self.stop_ids],
            "chat_template": None if template is None else [template.text, template.special_tokens],
        }
        text = json.dumps(state, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def extra_files(self) -> dict[str, bytes]:
        """Files an export writes next to the base model's tokenizer files, by name.

        When the chat template was chosen with ``load_tokenizer``'s ``chat_template`` (a
        named template, a ``.jinja`` file or template text) rather than being the folder's
        default, the copied tokenizer files would serve the base model's template; the export
        then also writes ``chat_template.jinja``, which ``transformers`` reads before
        ``tokenizer_config.json``'s ``chat_template``, so the exported model is served with
        the template it was trained on.

        Returns:
            ``{"chat_template.jinja": text}`` for an overridden template, else ``{}``.
        """
        if not self.chat_template_overridden:
            return {}
        return {"chat_template.jinja": self.chat_template.text.encode("utf-8")}

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Return the id of ``token``, or ``None`` if it is not in the vocabulary."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Return the token text of ``token_id``, or ``None`` if there is no such id."""
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Encode ``text``; special tokens written in the text become their ids.

        Args:
            text: The text.
            add_bos: Prepend BOS (only if this tokenizer adds BOS at all: ``add_bos_token``).
            add_eos: Append EOS.

        Returns:
            The token ids.
        """
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token:
            ids = [self.bos_id, *ids]
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Encode ``text`` without BOS/EOS and return each token's character span.

        Args:
            text: The text.

        Returns:
            ``(ids, offsets)`` where ``offsets[i] = (start, end)`` in characters of ``text``.
        """
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode ids to text.

        Args:
            ids: Token ids.
            skip_special_tokens: Leave out special tokens (BOS, EOS, template markers).

        Returns:
            The text.
        """
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _token_text(value: Any) -> str | None:
    """A special token as written in HF config files: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(read_model_text(path))
    except CheckpointError as error:
        raise DataError(str(error)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: not valid JSON ({error})") from error


def _post_processor_adds(tokenizer: _HFTokenizer, token: str | None) -> bool:
    """Whether ``tokenizer.json``'s post-processor starts a sequence with ``token``.

    With no ``add_bos_token`` in the config, this is what ``transformers`` does (Llama 3's
    post-processor adds ``<|begin_of_text|>``; GPT-2's adds nothing).
    """
    if token is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == tokenizer.token_to_id(token)


# Above this share of unknown (or padding) tokens among the content tokens of the first samples,
# a dataset build stops: the tokenizer does not fit the data (``allow_unknown_tokens`` allows it).
MAX_UNKNOWN_SHARE = 0.5
# Samples and content tokens the check looks at; fewer content tokens than the minimum decide
# nothing.
UNKNOWN_CHECK_SAMPLES = 64
_UNKNOWN_CHECK_MIN_TOKENS = 16


def check_tokens_fit(tokenizer: Tokenizer, token_lists: list[list[int]], where: str) -> None:
    """Stop when most content tokens of the first samples are the unknown or padding token.

    Content tokens are those that are not special tokens (role headers, BOS, EOS, end-of-turn
    tokens); the unknown token and a padding token that is not also EOS or a stop token count
    as content. A tokenizer that maps the data's words to them does not fit the data: training
    would run and learn nothing. This builds on the load-time refusal of a vocabulary of
    special tokens only, for a vocabulary that has ordinary tokens but not the data's.

    Args:
        tokenizer: The tokenizer.
        token_lists: The first samples' token ids.
        where: The dataset's sources, for the message.

    Raises:
        DataError: Naming the share, the count and a decoded sample, when the share of unknown
            or padding tokens is above ``MAX_UNKNOWN_SHARE``.
    """
    unfit = tokenizer.unfit_ids
    if not unfit:
        return
    specials = tokenizer.special_ids - unfit
    num_content = num_unfit = 0
    sample: list[int] | None = None
    for ids in token_lists:
        content = [i for i in ids if i not in specials]
        bad = sum(i in unfit for i in content)
        num_content += len(content)
        num_unfit += bad
        if bad and sample is None:
            sample = ids
    if num_content < _UNKNOWN_CHECK_MIN_TOKENS or num_unfit <= MAX_UNKNOWN_SHARE * num_content:
        return
    names = ", ".join(repr(tokenizer.id_to_token(i)) for i in sorted(unfit))
    shown = tokenizer.decode(sample or [], skip_special_tokens=False)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise DataError(
        f"{where}: {num_unfit / num_content:.0%} of the content tokens of the first "
        f"{len(token_lists)} samples ({num_unfit} of {num_content}) are {names}: the tokenizer "
        f"{tokenizer.source} does not fit the data (use the model's own tokenizer). A sample: "
        f"{shown!r}. Set allow_unknown_tokens: true to train on it anyway"
    )


def _refuse_special_only(tokenizer: _HFTokenizer, file: Path, specials: set[str]) -> None:
    """Refuse a vocabulary of special tokens only: every word of the data would be one of them.

    A vocabulary of nothing but ``<pad>``/``<unk>``/``</s>`` makes every word ``<unk>`` (or
    padding), and training on it runs to the end and learns nothing. ``specials`` are the
    BOS/EOS/pad token texts the config files name; the tokenizer's own special and unknown
    tokens are added here. One ordinary token is enough to pass.
    """
    specials = set(specials)
    specials.update(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
    unknown = getattr(tokenizer.model, "unk_token", None)
    if isinstance(unknown, str):
        specials.add(unknown)
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    if any(token not in specials for token in vocabulary):
        return
    shown = ", ".join(sorted(vocabulary, key=vocabulary.__getitem__)[:8])
    raise DataError(
        f"{file}: the vocabulary holds only special tokens ({shown}): every word of the data "
        "would become one of them; use the model's own tokenizer.json"
    )


def load_tokenizer(
    path: str | Path, max_seq_len: int | None = None, chat_template: str | None = None
) -> Tokenizer:
    """Load a tokenizer from a Hugging Face model folder or a ``tokenizer.json`` file.

    Special tokens come from ``tokenizer_config.json``, with ``special_tokens_map.json``
    filling what it leaves unset. Without either, BOS/EOS fall back to ``<|begin_of_text|>`` /
    ``<|end_of_text|>`` when the vocabulary has them.

    The chat template is the folder's ``chat_template.jinja`` (with
    ``additional_chat_templates/*.jinja`` as named ones), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}``); the one named
    ``default`` is used unless ``chat_template`` says otherwise.

    Args:
        path: A folder holding ``tokenizer.json`` (and optionally the config files), or the
            path of a ``tokenizer.json``.
        max_seq_len: Default maximum sequence length for datasets built with it.
        chat_template: Which chat template to use: the name of one of the tokenizer's named
            templates, the path of a ``.jinja`` file, or the template text itself (anything
            holding ``{{`` or ``{%``). None: the tokenizer's ``default``.

    Returns:
        The tokenizer.

    Raises:
        DataError: If ``tokenizer.json`` is missing or unreadable, no EOS token is known, it
            holds only special tokens, or a chat template file cannot be read.
        ConfigError: If ``chat_template`` names no template, file or template text.
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"tokenizer file not found: {file}")
    try:
        # From the bytes read through the checked open: a link out of the folder is refused.
        hf_tokenizer = _HFTokenizer.from_str(read_model_text(file))
    except CheckpointError as error:
        raise DataError(str(error)) from None
    except Exception as error:  # the Rust side raises plain Exception for a bad file
        raise DataError(f"{file}: cannot load tokenizer ({error})") from error
    folder = file.parent
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")

    def special(key: str, fallback: str | None) -> str | None:
        if key in config:  # an explicit null (Qwen's bos_token) means "none"
            return _token_text(config[key])
        if key in special_map:
            return _token_text(special_map[key])
        return fallback if fallback and hf_tokenizer.token_to_id(fallback) is not None else None

    bos = special("bos_token", "<|begin_of_text|>")
    eos = special("eos_token", "<|end_of_text|>")
    if eos is None:
        raise DataError(
            f"{folder}: no eos_token in tokenizer_config.json or special_tokens_map.json"
        )
    _refuse_special_only(
        hf_tokenizer, file, {token for token in (bos, eos, special("pad_token", None)) if token}
    )
    if chat_template is not None and not isinstance(chat_template, str):
        raise ConfigError(f"chat_template must be a string, got {type(chat_template).__name__}")
    # What templates see as bos_token, eos_token, ...: the config files only, like transformers
    # (no fallback to tokens that merely exist in the vocabulary).
    template_tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = _token_text(config[key]) if key in config else _token_text(special_map.get(key))
        if value is not None:
            template_tokens[key] = value
    found = find_chat_templates(folder, config)
    template, no_template_reason = select_chat_template(
        found, chat_template, template_tokens, folder
    )
    # What the folder serves by default (transformers picks "default"); another choice must
    # travel with exports.
    default_text = found["default"][0] if "default" in found else None
    overridden = template is not None and template.text != default_text
    generation = _read_json(folder / "generation_config.json")
    extra = generation.get("eos_token_id", [])
    extra_stop_ids = tuple(extra if isinstance(extra, list) else [extra])
    return Tokenizer(
        hf_tokenizer,
        bos_token=bos,
        eos_token=eos,
        pad_token=special("pad_token", None),
        add_bos_token=bool(config.get("add_bos_token", _post_processor_adds(hf_tokenizer, bos))),
        max_seq_len=max_seq_len,
        extra_stop_ids=extra_stop_ids,
        source=str(file),
        chat_template=template,
        no_chat_template_reason=no_template_reason,
        chat_template_overridden=overridden,
    )
