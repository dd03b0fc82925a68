"""Load a YAML config by built-in name or path, and apply command-line overrides."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunelab import _paths
from tunelab._paths import builtin_configs, suggest_path
from tunelab.config._renamed import rename_old_keys, rename_override
from tunelab.config._text_settings import NULL_WORDS, is_optional, is_text, setting_type
from tunelab.errors import ConfigError, first_line

_YAML_SUFFIXES = (".yaml", ".yml")
# A dotted key: names (letters, digits, '_' and '-') and list indices, e.g. `a.b`, `loggers.0.dir`.
_SCIENTIFIC_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")
_KEY_RE = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")


def _assets_resolver(name: str) -> str:
    if not name:
        raise ConfigError("${assets:NAME} needs a NAME, e.g. ${assets:tiny_llama}")
    return str(_paths.assets_dir() / name)


def _register_resolver(name: str, resolver: Callable[[str], str]) -> None:
    # OmegaConf 2.4 renamed register_new_resolver to register_resolver (the 2.0 function of that
    # name had other semantics, so tell them apart by the new keyword).
    register = getattr(OmegaConf, "register_resolver", None)
    if register is not None and "use_cache" in inspect.signature(register).parameters:
        register(name, resolver, replace=True)
    else:
        OmegaConf.register_new_resolver(name, resolver, replace=True)


# `${assets:NAME}` lets built-in configs point at the embedded tiny model and data, wherever the
# package is installed.
_register_resolver("assets", _assets_resolver)


def resolve_config_path(config: str) -> Path:
    """Find the YAML file a config argument names.

    Args:
        config: A path to a YAML file, or a built-in config name such as ``tiny/lora``.

    Returns:
        The path of the YAML file.

    Raises:
        ConfigError: If no such file and no such built-in config exists.
    """
    path = Path(config).expanduser()
    if path.is_file():
        return path
    builtins = builtin_configs()
    if config in builtins:
        return builtins[config]
    if path.is_dir():
        raise ConfigError(f"config {config} is a folder, expected a YAML file")
    if path.suffix in _YAML_SUFFIXES or path.is_absolute() or config.startswith("."):
        close = suggest_path(path)
        raise ConfigError(
            f"config file not found: {config}" + (f"; did you mean '{close}'?" if close else "")
        )
    if (_paths.recipes_dir() / f"{config}.py").is_file():
        raise ConfigError(
            f"'{config}' is a recipe, not a config (`tunelab ls` lists the configs of each recipe)"
        )
    message = f"unknown config '{config}': not a YAML file and not a built-in config"
    close = difflib.get_close_matches(config, list(builtins), n=1)
    if close:
        message += f"; did you mean '{close[0]}'?"
    else:
        message += " (`tunelab ls` lists them)"
    raise ConfigError(message)


def _read_yaml(path: Path) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from err
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror or err}") from err
    if isinstance(cfg, ListConfig) or (cfg is not None and not isinstance(cfg, DictConfig)):
        raise ConfigError(f"config {path} must be a mapping of keys to values at the top level")
    return cfg if cfg is not None else OmegaConf.create({})


def _scientific_floats(value: object) -> object:
    # YAML 1.1 reads `1e-4` (no dot) as a string; OmegaConf's file loader reads it as a float,
    # so a value means the same on the command line as in a file.
    if isinstance(value, str) and _SCIENTIFIC_RE.fullmatch(value):
        return float(value)
    if isinstance(value, list):
        return [_scientific_floats(item) for item in value]
    if isinstance(value, dict):
        return {key: _scientific_floats(item) for key, item in value.items()}
    return value


def _parse_value(text: str, override: str, hint: object | None = None) -> object:
    # An empty value means an empty string: YAML would read it as null, but `key=` on a command
    # line reads as "set to nothing", and `key=null` says null explicitly.
    if text == "":
        return ""
    if hint is not None and is_text(hint):
        # A text setting takes the text as typed (`#`, `: `, braces, a leading `-`, newlines);
        # `null` still means None where the setting allows it.
        return None if text in NULL_WORDS and is_optional(hint) else text
    try:
        return _scientific_floats(yaml.safe_load(text))
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not a valid YAML value"
        raise ConfigError(f"bad override '{override}': {problem}") from err


def _delete_key(cfg: DictConfig, key: str, override: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key else cfg
    if isinstance(parent, DictConfig) and leaf in parent.keys():
        del parent[leaf]
        return
    if isinstance(parent, ListConfig) and leaf.isdigit() and int(leaf) < len(parent):
        del parent[int(leaf)]
        return
    raise ConfigError(f"cannot apply override '{override}': the config has no key '{key}'")


def apply_overrides(
    cfg: DictConfig, overrides: Sequence[str], args_cls: type | None = None
) -> DictConfig:
    """Apply command-line overrides to a config, in order, in place.

    ``key=value`` and ``a.b.c=value`` set a value (created if absent; a mapping value replaces
    the node rather than merging into it), ``~key`` deletes a key. Values are parsed as YAML:
    ``3`` is an int, ``1e-4`` a float, ``[a,b]`` a list, ``null`` is None, ``true`` a bool;
    except that a key ``args_cls`` declares as text (``str``, ``Path``, a ``Literal`` of
    strings; a built-in component's text argument such as ``tokenizer.path``) takes the value
    literally, ``#``, ``: ``, braces, a leading ``-`` and newlines included (``null`` is still
    None where the setting allows None).

    Args:
        cfg: The config to change.
        overrides: The override strings.
        args_cls: The recipe's settings dataclass, or None to parse every value as YAML.

    Returns:
        The same config, for chaining.

    Raises:
        ConfigError: If an override is malformed or deletes a key that does not exist.
    """
    for override in overrides:
        if override.startswith("~"):
            key = override[1:]
            if not _KEY_RE.match(key):
                raise ConfigError(f"bad override '{override}': expected ~key or ~a.b.c")
            _delete_key(cfg, key, override)
            continue
        key, sep, text = override.partition("=")
        if not sep or not _KEY_RE.match(key):
            raise ConfigError(f"bad override '{override}': expected key=value, a.b.c=value or ~key")
        hint = setting_type(args_cls, cfg, key) if args_cls is not None else None
        value = _parse_value(text, override, hint)
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException as err:
            raise ConfigError(f"cannot apply override '{override}': {first_line(err)}") from err
    return cfg


def load_config(
    config: str,
    overrides: Sequence[str] = (),
    args_cls: type | None = None,
    renamed: list[tuple[str, str]] | None = None,
) -> DictConfig:
    """Load a config by built-in name or path and apply overrides.

    Interpolations (``${other.key}``, ``${assets:NAME}``) stay lazy: they resolve when a value
    is read, so an override of ``other.key`` reaches every place that refers to it. An override
    of a text setting is taken literally (see ``apply_overrides``) when ``args_cls``, the
    recipe's settings, says which settings are text (``tunelab.cli`` finds them from the
    config's ``recipe`` key: ``load_recipe_config``).

    Args:
        config: A path to a YAML file, or a built-in config name such as ``tiny/lora``.
        overrides: ``key=value`` / ``~key`` strings, applied in order.
        args_cls: The recipe's settings dataclass (None: every value is parsed as YAML, and
            no old flat key is mapped).
        renamed: Receives the ``(old, new)`` pair of every old flat key that was mapped to its
            section (``batch_size`` -> ``schedule.batch_size``; see ``_renamed``), for the
            caller to say so once.

    Returns:
        The config, its old flat keys (file and overrides) moved to their sections.

    Raises:
        ConfigError: If the config is not found, is not valid YAML, or an override is bad.
    """
    path = resolve_config_path(config)
    cfg, moved = rename_old_keys(_read_yaml(path), args_cls, str(path))
    mapped = []
    for override in overrides:
        override, pair = rename_override(override, args_cls)
        mapped.append(override)
        if pair is not None:
            moved.append(pair)
    if renamed is not None:
        renamed.extend(pair for pair in moved if pair not in renamed)
    return apply_overrides(cfg, mapped, args_cls)
