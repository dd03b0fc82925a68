"""Check a Hugging Face model folder before any process starts, from its JSON files alone.

Nothing here imports torch or reads tensor data: ``config.json``, the safetensors headers,
``model.safetensors.index.json`` and the tokenizer's JSON files say enough to catch a wrong
folder, an incomplete download, pickled-only weights, an unsupported family or a tokenizer that
does not fit the model, in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunelab._model_files import bad_links, open_model_file, read_model_text
from tunelab._paths import builtin_configs, suggest_path
from tunelab.errors import CheckpointError

_PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Model folder names that say which hub organisation publishes them (lower-case prefixes).
_ORGANISATIONS = (
    ("meta-llama", "meta-llama"),
    ("llama", "meta-llama"),
    ("qwen", "Qwen"),
    ("mistral", "mistralai"),
    ("mixtral", "mistralai"),
    ("gemma", "google"),
    ("phi", "microsoft"),
    ("gpt-oss", "openai"),
    ("smollm", "HuggingFaceTB"),
)
_DOWNLOAD_LINE = re.compile(r"tunelab download (\S+) --output-dir (\S+)")
_HUB_CACHE_DIR = re.compile(r"models--([^/]+?)--([^/]+)")


def read_json(path: Path) -> tuple[Any, str | None]:
    """Return ``(data, None)``, or ``(None, problem)`` naming the file and the JSON error.

    The file is read as a file of its folder (``tunelab._model_files``): a link out of it, or a
    FIFO or device, is a problem, never read.
    """
    try:
        return json.loads(read_model_text(path)), None
    except CheckpointError as err:
        return None, str(err)
    except OSError as err:
        return None, f"cannot read {path}: {err.strerror or err}"
    except UnicodeDecodeError:
        return None, f"{path} is not a text file (expected JSON)"
    except json.JSONDecodeError as err:
        return None, f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"


def _read_model_config(path: Path) -> tuple[Any, str | None]:
    """``read_json`` of a model's ``config.json``, with a multimodal model's language keys.

    A vision-language config (transformers 5) keeps ``vocab_size`` and the other language
    model keys under ``text_config``; they are read as if at the top level (which wins).
    """
    config, problem = read_json(path)
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], **config}
    return config, problem


def repo_hint(folder: Path) -> str | None:
    """Guess the hub repository a model folder was meant to hold.

    In order: a hub cache folder name (``models--org--name``), a ``tunelab download REPO
    --output-dir DIR`` line in a built-in config whose DIR is this folder, the
    ``_name_or_path`` of a ``config.json`` already there, then the folder name with the
    organisation that publishes models of that name.

    Args:
        folder: The model folder (it may not exist).

    Returns:
        ``org/name``, or None.
    """
    match = _HUB_CACHE_DIR.search(folder.as_posix())
    if match:
        return f"{match.group(1)}/{match.group(2)}"
    for config in builtin_configs().values():
        try:
            text = config.read_text(encoding="utf-8")
        except OSError:
            continue
        for repo, output_dir in _DOWNLOAD_LINE.findall(text):
            if Path(output_dir).name == folder.name:
                return repo
    config, _ = read_json(folder / "config.json") if folder.is_dir() else (None, None)
    name_or_path = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(name_or_path, str) and name_or_path.count("/") == 1:
        if not Path(name_or_path).exists():
            return name_or_path
    lowered = folder.name.lower()
    for prefix, organisation in _ORGANISATIONS:
        if lowered.startswith(prefix) and folder.name:
            return f"{organisation}/{folder.name}"
    return None


_OUTPUT_DIR_LINE = re.compile(r"^output_dir: (\S+)$", re.MULTILINE)
_RECIPE_LINE = re.compile(r"^recipe: (\S+)$", re.MULTILINE)


def download_hint(path: str) -> str:
    """Return how to fill the model folder: the shipped run that makes it, or a download."""
    made_by = _shipped_run_making(Path(path))
    if made_by is not None:
        name, recipe = made_by
        return (
            f"it is made by the shipped config {name}: run `tunelab run --nproc_per_node 2 "
            f"{recipe} --config {name}` first"
        )
    repo = repo_hint(Path(path).expanduser()) or "<org>/<model>"
    return f"download it with `tunelab download {repo} --output-dir {path}`"


def _shipped_run_making(folder: Path) -> tuple[str, str] | None:
    # A shipped config whose run writes the folder (its output_dir, or an export under it),
    # as tiny/agentic_grpo starts from tiny/agentic_sft's epoch export: (config, recipe).
    if folder.is_absolute():
        return None
    for name, config in builtin_configs().items():
        try:
            text = config.read_text(encoding="utf-8")
        except OSError:
            continue
        output_dir, recipe = _OUTPUT_DIR_LINE.search(text), _RECIPE_LINE.search(text)
        if output_dir is None or recipe is None:
            continue
        root = Path(output_dir.group(1))
        if folder == root or root in folder.parents:
            return name, recipe.group(1)
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # An AddedToken written out: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_vocabulary(file: Path) -> tuple[dict[str, int] | None, str | None]:
    """Return every token of a ``tokenizer.json`` and its id, or ``(None, problem)``."""
    data, problem = read_json(file)
    if problem:
        return None, problem
    if not isinstance(data, dict):
        return None, f"{file}: expected a JSON object"
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    tokens: dict[str, int] = {}
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        tokens.update({t: i for t, i in vocab.items() if isinstance(i, int)})
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        tokens.update({entry[0]: i for i, entry in enumerate(vocab) if entry})
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            tokens[str(added.get("content"))] = added["id"]
    if not tokens:
        return None, f"{file}: no vocabulary (model.vocab and added_tokens are empty)"
    return tokens, None


def tokenizer_problems(tokenizer: Path, vocab_size: int, config_file: Path) -> list[str]:
    """Check that a tokenizer fits a model whose embedding has ``vocab_size`` rows.

    Every token id must be below ``vocab_size`` (a larger id would index past the embedding),
    and the special tokens ``tokenizer_config.json`` / ``special_tokens_map.json`` name must be
    in the vocabulary.

    Args:
        tokenizer: A folder holding ``tokenizer.json``, or the file itself.
        vocab_size: The model's ``vocab_size``.
        config_file: The model's ``config.json``, for messages.

    Returns:
        One message per problem.
    """
    file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    tokens, problem = tokenizer_vocabulary(file)
    if tokens is None:
        return [problem or f"{file}: unreadable"]
    problems = []
    too_large = sorted((i, t) for t, i in tokens.items() if i >= vocab_size or i < 0)
    if too_large:
        largest, text = too_large[-1]
        problems.append(
            f"{file} does not fit the model: {len(too_large)} token id(s) are not below "
            f"vocab_size {vocab_size} of {config_file} (largest: {largest}, {text!r})"
        )
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings, problem = read_json(file.parent / name)
        if problem and (file.parent / name).exists():
            problems.append(problem)
            continue
        if not isinstance(settings, dict):
            continue
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(settings.get(key))
            if text is not None and text not in tokens:
                problems.append(f"{file.parent / name}: {key} {text!r} is not in {file}")
        if name == "tokenizer_config.json":
            break  # It wins over special_tokens_map.json, as in load_tokenizer.
    return problems


def _supported_families() -> dict[str, str]:
    from tunelab.config._static import supported_model_types

    found = supported_model_types()
    # Read from the source so that config stays below models (and torch-free); the test
    # test_supported_model_types_read_from_source_match_the_package holds the two equal.
    assert found is not None, "tunelab.models.families.FAMILIES is no longer a literal dict"
    return found


# Mixture-of-experts families: the config.json keys that give the number of experts, in the
# order each family reads them, the top-k key, and the defaults transformers uses when a key
# is absent. Read here (no torch) by `tunelab validate` and by each family's config parser.
MOE_KEYS: dict[str, tuple[tuple[str, ...], int, int]] = {
    "mixtral": (("num_local_experts", "num_experts"), 8, 2),
    "qwen3_moe": (("num_experts", "num_local_experts"), 128, 8),
    "gpt_oss": (("num_local_experts", "num_experts"), 128, 4),
}


def expert_counts(config: Mapping[str, Any], family: str) -> tuple[tuple[int, int] | None, str]:
    """``(num_experts, num_experts_per_tok)`` of an MoE ``config.json``, or ``(None, problem)``.

    A key that is absent (or null) takes the family's default; one that is present is taken as
    it is: ``num_local_experts: 0`` is zero experts, refused, not the default.

    Args:
        config: The parsed ``config.json``.
        family: A ``MOE_KEYS`` family.

    Returns:
        The counts and "", or None and the problem (naming the key and its value).
    """
    keys, default_experts, default_top_k = MOE_KEYS[family]
    key = next((k for k in keys if config.get(k) is not None), None)
    experts = config[key] if key is not None else default_experts
    top_k = config.get("num_experts_per_tok")
    top_k = default_top_k if top_k is None else top_k
    for name, value in ((key or keys[0], experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None, f"{name} must be a positive integer, got {value!r}"
    if top_k > experts:
        return None, (
            f"num_experts_per_tok {top_k} is more than the {experts} experts "
            f"({key or keys[0]}): each token can be routed to at most every expert"
        )
    return (experts, top_k), ""


def _config_problems(config: Mapping[str, Any], config_file: Path) -> list[str]:
    problems = []
    families = _supported_families()
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    known = set(families.values())
    if model_type not in families and not (
        isinstance(architectures, list) and known.intersection(map(str, architectures))
    ):
        problems.append(
            f"{config_file}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(families))})"
        )
    family = model_type if model_type in MOE_KEYS else None
    for name, architecture in families.items():
        if name in MOE_KEYS and isinstance(architectures, list) and architecture in architectures:
            family = name
    if family is not None:
        _, problem = expert_counts(config, family)
        if problem:
            problems.append(f"{config_file}: {problem}")
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        problems.append(f"{config_file}: vocab_size must be a positive integer, got {vocab_size!r}")
        return problems
    for key in _SPECIAL_ID_KEYS:
        ids = config.get(key)
        for token_id in ids if isinstance(ids, list) else [ids]:
            if isinstance(token_id, int) and not 0 <= token_id < vocab_size:
                problems.append(
                    f"{config_file}: {key} {token_id} is not below vocab_size {vocab_size}"
                )
    return problems


def _safetensors_problem(file: Path) -> str | None:
    # A safetensors file is an 8-byte little-endian header length, a JSON header whose
    # data_offsets say where each tensor's bytes are, then the bytes: a cut download is short.
    try:
        with open_model_file(file) as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"{file} is not a safetensors file (it is {size} bytes long)"
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(size - 8, 100_000_000):
                return f"{file} is not a safetensors file (bad header length)"
            header = json.loads(handle.read(header_size))
    except CheckpointError as err:
        return str(err)
    except OSError as err:
        return f"cannot read {file}: {err.strerror or err}"
    except (ValueError, UnicodeDecodeError):
        return f"{file} is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{file} is not a safetensors file (its header is not a JSON object)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and entry.get("data_offsets")
    ]
    expected = 8 + header_size + max(ends, default=0)
    if size < expected:
        return f"{file} is truncated: {size} bytes, its header describes {expected}"
    return None


def _weight_problems(folder: Path, path: str) -> list[str]:
    index_file = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index_file.exists():
        index, problem = read_json(index_file)
        if problem:
            return [problem]
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            return [f"{index_file}: no weight_map"]
        missing = sorted({str(f) for f in weight_map.values()} - {f.name for f in files})
        if missing:
            return [
                f"{index_file} names {len(missing)} file(s) that are not in {path} "
                f"(first: {missing[0]}): an incomplete download? " + download_hint(path)
            ]
    if not files:
        pickled = sorted(f.name for f in folder.iterdir() if f.suffix in _PICKLED_SUFFIXES)
        if pickled:
            return [
                f"{path} holds only pickled weights ({', '.join(pickled)}); tunelab reads "
                "safetensors only and never unpickles a model: " + download_hint(path)
            ]
        return [f"{path} has no *.safetensors weights; " + download_hint(path)]
    return [problem for file in files if (problem := _safetensors_problem(file))]


def _instead(folder: Path) -> str:
    """What to do about a folder without config.json: tunelab's own outputs are common here."""
    if (folder / "adapter_config.json").is_file():
        return "it is a PEFT adapter: pass it as adapter_dir and the base model as model.path"
    if (folder / ".metadata").is_file() or re.fullmatch(r"step_\d+", folder.name):
        return (
            "it is a resumable step checkpoint: use an epoch_E export (or resume_from_checkpoint)"
        )
    exports = sorted(p.name for p in folder.glob("epoch_*") if (p / "config.json").is_file())
    if exports:
        return f"it holds the exports {', '.join(exports)}: point model.path at one of them"
    return download_hint(str(folder))


def model_dir_problems(path: str) -> list[str]:
    """Return every problem of a Hugging Face model folder (see ``constraints.ModelDir``).

    Args:
        path: The folder, as the config gives it.

    Returns:
        One message per problem; each names the file it is about.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        close = suggest_path(folder)
        if close:
            return [
                f"model folder not found: {path}; did you mean '{close}'? If not, "
                + download_hint(path)
            ]
        return [f"model folder not found: {path}; " + download_hint(path)]
    if not folder.is_dir():
        return [f"{path} is a file, expected a model folder (config.json, *.safetensors, ...)"]
    config_file = folder / "config.json"
    if not config_file.is_file():
        return [f"{path} has no config.json: not a Hugging Face model folder; " + _instead(folder)]
    links = bad_links(folder)
    if links:  # Before anything in the folder is read.
        return links
    config, problem = _read_model_config(config_file)
    if problem:
        return [problem]
    if not isinstance(config, dict):
        return [f"{config_file}: expected a JSON object"]
    problems = _config_problems(config, config_file)
    problems += _weight_problems(folder, path)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        only = (
            " (only tokenizer.model, which tunelab does not read)"
            if (folder / "tokenizer.model").exists()
            else ""
        )
        problems.append(f"{path} has no tokenizer.json{only}; " + download_hint(path))
    elif isinstance(config.get("vocab_size"), int) and config["vocab_size"] > 0:
        problems += tokenizer_problems(tokenizer, config["vocab_size"], config_file)
    return problems


def model_context_length(model_dir: str | Path) -> int | None:
    """The longest sequence a model takes, ``max_position_embeddings`` of its ``config.json``.

    Returns:
        The length, or None when the file, the key or its value is missing or unreadable (the
        folder's own check reports a broken folder).
    """
    config_file = Path(model_dir).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    config, problem = _read_model_config(config_file)
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if problem or isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def tokenizer_fits_model(tokenizer: Path, model_dir: Path) -> list[str]:
    """Check a tokenizer kept outside the model folder against the model's ``vocab_size``.

    The model folder's own ``tokenizer.json`` is checked with the folder (``ModelDir``), and a
    missing or unreadable file is reported by the checks of its own key, so both give nothing
    here.

    Args:
        tokenizer: A folder holding ``tokenizer.json``, or the file itself.
        model_dir: The model folder.

    Returns:
        One message per problem.
    """
    tokenizer, model_dir = tokenizer.expanduser(), model_dir.expanduser()
    file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    if not file.is_file() or file.resolve() == (model_dir / "tokenizer.json").resolve():
        return []
    config_file = model_dir / "config.json"
    config, problem = _read_model_config(config_file) if config_file.is_file() else (None, None)
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if problem or isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        return []
    return tokenizer_problems(file, vocab_size, config_file)
