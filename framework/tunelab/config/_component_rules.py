"""What values the arguments of the built-in components allow.

The builders live in packages that import torch (``tunelab.training``, ``tunelab.data``,
``tunelab.rl``), and ``tunelab validate`` must not import torch, so their rules are kept here,
keyed by the defining module and name of each builder (what ``_static.resolve_static`` and
``import_component`` both report), in the same ``Annotated[type, constraint...]`` language as
the recipe settings. A unit test checks that every key names a real callable and every argument
is in its signature, so the table cannot drift from the code. A rule covers only what the config
sets; a builder still checks its arguments itself when it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from tunelab.config.constraints import (
    Finite,
    NonEmpty,
    OneOf,
    Range,
    TokenizerPath,
    missing_path_message,
)


@dataclass(frozen=True)
class ComponentRules:
    """The rules of one component's arguments.

    Attributes:
        args: Argument name to its type hint (with ``Annotated`` constraints).
        check: A rule over several arguments: takes the config's arguments (plain values)
            and returns ``(argument, problem)`` pairs.
    """

    args: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Mapping[str, Any]], list[tuple[str, str]]] | None = None


PositiveLR = Annotated[float, Finite(), Range(gt=0)]
Beta = Annotated[float, Range(ge=0, lt=1)]
NonNegativeFloat = Annotated[float, Finite(), Range(ge=0)]
PositiveFloat = Annotated[float, Finite(), Range(gt=0)]
Steps = Annotated[int, Range(ge=0)]
SequenceLength = Annotated[int, Range(ge=1)] | None
AUTO_TEMPLATE = "auto"
"""The tokenizer's own chat template."""
NAMED_TEMPLATES = ("instruct", "alpaca", "llama3", "chatml")
"""The named formats for base models, defined here once: ``tunelab.data.TEMPLATES`` implements
them in this order, and settings (``template``) allow them without importing the data code."""
TEMPLATE_NAMES = (AUTO_TEMPLATE, *NAMED_TEMPLATES)
Template = Annotated[str, OneOf(*TEMPLATE_NAMES)]
Split = Annotated[str, NonEmpty()]
# Loader names and file suffixes tunelab.data.sources accepts; a unit test keeps them equal.
LOADERS = ("json", "parquet", "text", "csv")
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt", ".text", ".csv", ".arrow")


def _data_files(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [item for files in value.values() for item in _data_files(files)]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def check_data_source(args: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The local files it reads exist: data_files for a json/parquet/text/csv source, or a local source.

    ``source`` is a loader name (then ``data_files`` must name existing files), a local file
    or folder, or a hub dataset id (not checked: that needs the network).

    Args:
        args: The builder's arguments from the config.

    Returns:
        ``(argument, problem)`` pairs.
    """
    source = args.get("source")
    if not isinstance(source, str) or not source.strip():
        return []  # Its own rule reports it.
    if source in LOADERS:
        files = args.get("data_files")
        if files is None:
            return [("data_files", f"source {source!r} needs data_files (the path of the file)")]
        problems = []
        for file in _data_files(files):
            if not isinstance(file, str) or not file:
                problems.append(("data_files", f"expected a file path, got {file!r}"))
            elif not Path(file).expanduser().is_file():
                problems.append(("data_files", missing_path_message("data file", file)))
        return problems
    path = Path(source).expanduser()
    if path.suffix.lower() in DATA_SUFFIXES and not path.is_file():
        return [("source", missing_path_message("data file", source))]
    if source.startswith((".", "/", "~")) and not path.exists():
        return [("source", missing_path_message("data source", source))]
    return []


_DATASET = {
    "source": Annotated[str, NonEmpty()],
    "split": Split,
    "template": Template,
    "max_seq_len": SequenceLength,
    "train_on_input": bool,
    "packed": bool,
    "skip_malformed": bool,
    "allow_unknown_tokens": bool,
    "column_map": dict[str, Annotated[str, NonEmpty()]] | None,
    "num_proc": Annotated[int, Range(ge=1)] | None,
    "cache_dir": Annotated[str, NonEmpty()] | None,
    "streaming": bool,
    "shuffle_buffer_size": Annotated[int, Range(ge=1)] | None,
}
PixelCount = Annotated[int, Range(ge=1)]
_IMAGES = {
    "images_column": Annotated[str, NonEmpty()],
    "image_token": Annotated[str, NonEmpty()],
    "max_image_pixels": PixelCount,
    # The pixels of one row's images together after resizing (tunelab.data.image_budget).
    "max_pixels_per_sample": PixelCount | None,
}
"""The image arguments of the datasets whose rows may hold images."""
_ADAM = {
    "lr": PositiveLR,
    "betas": tuple[Beta, Beta],
    "eps": PositiveFloat,
    "weight_decay": NonNegativeFloat,
}

RULES: dict[str, ComponentRules] = {
    # Optimizers.
    "tunelab.training.optim.adamw": ComponentRules({**_ADAM, "fused": bool | None}),
    "torch.optim.adamw.AdamW": ComponentRules(_ADAM),
    "torch.optim.adam.Adam": ComponentRules(_ADAM),
    "torch.optim.sgd.SGD": ComponentRules(
        {"lr": PositiveLR, "momentum": NonNegativeFloat, "weight_decay": NonNegativeFloat}
    ),
    # LR schedules.
    "tunelab.training.lr_schedules.cosine_schedule_with_warmup": ComponentRules(
        {
            "num_warmup_steps": Steps,
            "min_lr_ratio": Annotated[float, Range(ge=0, le=1)],
            "num_cycles": PositiveFloat,
        }
    ),
    "tunelab.training.lr_schedules.constant_schedule_with_warmup": ComponentRules(
        {"num_warmup_steps": Steps}
    ),
    # Tokenizer and datasets.
    "tunelab.data.tokenizer.load_tokenizer": ComponentRules(
        {"path": Annotated[str, NonEmpty(), TokenizerPath()], "max_seq_len": SequenceLength}
    ),
    "tunelab.data.sft.instruct_dataset": ComponentRules(_DATASET, check_data_source),
    "tunelab.data.sft.chat_dataset": ComponentRules(
        {
            # Conversations name their column (conversation_column), not a column_map.
            **{key: rule for key, rule in _DATASET.items() if key != "column_map"},
            "conversation_column": Annotated[str, NonEmpty()] | None,
            "conversation_style": Annotated[str, OneOf("auto", "openai", "sharegpt")],
            "train_on_reasoning": bool,
        },
        check_data_source,
    ),
    "tunelab.data.sft.text_dataset": ComponentRules(
        {
            "source": Annotated[str, NonEmpty()],
            "split": Split,
            "column": Annotated[str, NonEmpty()],
            "max_seq_len": SequenceLength,
            "packed": bool,
            "skip_malformed": bool,
            "allow_unknown_tokens": bool,
            "num_proc": _DATASET["num_proc"],
            "cache_dir": _DATASET["cache_dir"],
            "streaming": bool,
            "shuffle_buffer_size": _DATASET["shuffle_buffer_size"],
        },
        check_data_source,
    ),
    "tunelab.data.preference.preference_dataset": ComponentRules(
        {
            key: _DATASET[key]
            for key in (
                "source",
                "split",
                "template",
                "max_seq_len",
                "column_map",
                "allow_unknown_tokens",
                "num_proc",
                "cache_dir",
            )
        },  # fmt: skip
        check_data_source,
    ),
    # KTO's labelled completions: the preference dataset's arguments.
    "tunelab.data.unpaired.kto_dataset": ComponentRules(
        {
            key: _DATASET[key]
            for key in (
                "source",
                "split",
                "template",
                "max_seq_len",
                "column_map",
                "allow_unknown_tokens",
                "num_proc",
                "cache_dir",
            )
        },  # fmt: skip
        check_data_source,
    ),
    # GRPO's prompts: the sources and source options of the datasets above.
    "tunelab.data.prompts.prompt_dataset": ComponentRules(
        {
            **{key: _DATASET[key] for key in ("source", "split", "skip_malformed")},
            "allow_unknown_tokens": bool,
            "template": Template | None,
            "prompt_column": Annotated[str, NonEmpty()],
            **_IMAGES,
        },
        check_data_source,
    ),
    # Chat rows and preference pairs with images (vision-language models). Their data files
    # are not checked here: the shipped VL configs name the user's own (/tmp/vl_data/...).
    "tunelab.data.image_dataset.image_chat_dataset": ComponentRules(
        {
            **{
                key: _DATASET[key]
                for key in ("source", "split", "max_seq_len", "packed", "skip_malformed")
            },
            **{key: _DATASET[key] for key in ("num_proc", "cache_dir")},
            "conversation_column": Annotated[str, NonEmpty()],
            **_IMAGES,
            "max_image_bytes": Annotated[int, Range(ge=1)],
            "image_fetch_timeout": PositiveFloat,
        },
    ),
    "tunelab.data.image_preference.image_preference_dataset": ComponentRules(
        {
            **{
                key: _DATASET[key]
                for key in ("source", "split", "max_seq_len", "skip_malformed", "column_map")
            },
            **{key: _DATASET[key] for key in ("num_proc", "cache_dir")},
            **_IMAGES,
        },
    ),
    "tunelab.data.mix.mix_dataset": ComponentRules(
        {
            "weights": list[NonNegativeFloat],
            "num_samples": Annotated[int, Range(ge=1)] | None,
            "seed": int,
        }
    ),
    # Losses.
    "tunelab.losses.cross_entropy.CrossEntropyLoss": ComponentRules(
        {"num_chunks": Annotated[int, Range(ge=1)] | None, "ignore_index": int}
    ),
    "tunelab.losses.preference.DPOLoss": ComponentRules(
        {"beta": PositiveFloat, "label_smoothing": Annotated[float, Range(ge=0, lt=0.5)]}
    ),
    "tunelab.losses.preference.IPOLoss": ComponentRules({"tau": PositiveFloat}),
    "tunelab.losses.preference.HingeLoss": ComponentRules({"beta": PositiveFloat}),
    "tunelab.losses.preference.SimPOLoss": ComponentRules(
        {"beta": PositiveFloat, "gamma": Annotated[float, Finite()]}
    ),
    "tunelab.losses.orpo.ORPOLoss": ComponentRules({"beta": PositiveFloat}),
    "tunelab.losses.kto.KTOLoss": ComponentRules(
        {
            "beta": PositiveFloat,
            "desirable_weight": PositiveFloat,
            "undesirable_weight": PositiveFloat,
        }
    ),
    # RL policy losses (grpo_distributed's loss).
    "tunelab.rl.grpo_loss.GRPOLoss": ComponentRules(
        {
            "clip_eps_low": Annotated[float, Finite(), Range(ge=0, lt=1)],
            "clip_eps_high": NonNegativeFloat,
            "beta": NonNegativeFloat,
            "aggregation": Annotated[str, OneOf("sequence_mean", "token_mean", "constant_length")],
        }
    ),
    "tunelab.rl.gspo_loss.GSPOLoss": ComponentRules(
        {
            "clip_eps_low": Annotated[float, Finite(), Range(ge=0, lt=1)],
            "clip_eps_high": NonNegativeFloat,
            "beta": NonNegativeFloat,
        }
    ),
    # Metric loggers.
    "tunelab.training.metric_logging.JsonlLogger": ComponentRules(
        {"log_dir": Annotated[str, NonEmpty()], "filename": Annotated[str, NonEmpty()]}
    ),
    "tunelab.training.metric_logging.TensorBoardLogger": ComponentRules(
        {"log_dir": Annotated[str, NonEmpty()]}
    ),
    "tunelab.training.metric_logging.WandBLogger": ComponentRules(
        {"project": Annotated[str, NonEmpty()], "log_dir": Annotated[str, NonEmpty()] | None}
    ),
}
