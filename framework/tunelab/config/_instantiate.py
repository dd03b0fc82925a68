"""Build objects from ``_component_`` nodes: ``{_component_: torch.optim.AdamW, lr: 1e-3}``."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunelab.config._static import StaticCallable, StaticMissing, resolve_static
from tunelab.errors import ConfigError, first_line

COMPONENT_KEY = "_component_"


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_dotted(dotted: object, where: str) -> None:
    if not isinstance(dotted, str) or "." not in dotted or not all(dotted.split(".")):
        raise ConfigError(
            f"{where}: expected a dotted path like 'torch.optim.AdamW', got {dotted!r}"
        )


def _no_attribute(where: str, dotted: str, owner: str, attr: str, known: list[str]) -> str:
    message = f"{where}: cannot import '{dotted}': '{owner}' has no attribute '{attr}'"
    close = difflib.get_close_matches(attr, known, n=1)
    return message + (f"; did you mean '{owner}.{close[0]}'?" if close else "")


def import_component(dotted: object, where: str = COMPONENT_KEY) -> Any:
    """Import the object a ``_component_`` dotted path names.

    The longest importable module prefix is imported and the rest is looked up as attributes,
    so ``pkg.mod.func``, ``pkg.mod.Class`` and ``pkg.mod.Class.classmethod`` all work.

    Args:
        dotted: The dotted path from the config.
        where: The config key holding the path, for error messages.

    Returns:
        The module attribute (class, function, ...).

    Raises:
        ConfigError: If the path is not a string or does not resolve.
    """
    _check_dotted(dotted, where)
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            target: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only "this prefix is not a module" means: try a shorter prefix. A module that
            # exists but imports something missing is reported as it is.
            if err.name is not None and module_name.startswith(err.name):
                continue
            raise ConfigError(f"{where}: cannot import '{dotted}': {err}") from err
        for depth, attr in enumerate(parts[split:], start=split):
            if not hasattr(target, attr):
                owner = ".".join(parts[:depth])
                known = [n for n in dir(target) if not n.startswith("_")]
                raise ConfigError(_no_attribute(where, dotted, owner, attr, known))
            target = getattr(target, attr)
        if not callable(target):
            raise ConfigError(f"{where}: '{dotted}' is not callable")
        return target
    raise ConfigError(f"{where}: cannot import '{dotted}': no module named '{parts[0]}'")


def inspect_component(dotted: object, where: str = COMPONENT_KEY) -> tuple[str, Any]:
    """Find what a ``_component_`` names and its signature, importing only when needed.

    A ``tunelab.*`` path is read from the source (``_static``), so checking the built-in
    configs never imports torch; anything the source cannot settle, and every other package,
    is imported with ``import_component``. Nothing is called.

    Args:
        dotted: The dotted path from the config.
        where: The config key holding the path, for error messages.

    Returns:
        ``(name, signature)``: the defining module and qualified name (the key of the
        component rules, e.g. ``tunelab.training.optim.adamw``), and an
        ``inspect.Signature`` or None when the callable has none.

    Raises:
        ConfigError: If the path is not a string or does not resolve.
    """
    _check_dotted(dotted, where)
    assert isinstance(dotted, str)
    found = resolve_static(dotted)
    if isinstance(found, StaticCallable):
        return found.name, found.signature
    if isinstance(found, StaticMissing):
        raise ConfigError(
            _no_attribute(where, dotted, found.owner, found.attribute, list(found.known))
        )
    target = import_component(dotted, where)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        signature = None  # Some builtins have no signature.
    return name, signature


def check_call(target: Any, dotted: str, kwargs: dict[str, Any], where: str) -> None:
    """Check that keyword arguments bind to a callable's signature.

    Args:
        target: The callable.
        dotted: Its dotted path, for messages.
        kwargs: The keyword arguments it will get.
        where: The config path of the node, for messages.

    Raises:
        ConfigError: If the arguments do not bind.
    """
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # Some builtins have no signature; the call itself will tell.
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{where}: cannot call {dotted} with these arguments: {err}") from err


def _build(value: Any, path: str) -> Any:
    if isinstance(value, dict):
        if COMPONENT_KEY in value:
            return _call(value, path, (), {})
        return {key: _build(item, _join(path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_build(item, _join(path, index)) for index, item in enumerate(value)]
    return value


def _call(node: dict, path: str, args: tuple, overrides: dict[str, Any]) -> Any:
    dotted = node[COMPONENT_KEY]
    target = import_component(dotted, _join(path, COMPONENT_KEY))
    kwargs = {
        key: _build(item, _join(path, key)) for key, item in node.items() if key != COMPONENT_KEY
    }
    kwargs.update(overrides)  # The call site wins over the config.
    if not args:
        check_call(target, dotted, kwargs, path or "config")
    return target(*args, **kwargs)


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a config node describes.

    A mapping with ``_component_`` is called with its other keys as keyword arguments, after
    those are built the same way (recursively, through nested mappings and lists). Keyword
    arguments given here win over the config's. Nodes without ``_component_`` come back as
    plain Python containers, ``None`` as ``None``.

    Args:
        node: A ``DictConfig``/``ListConfig``/dict/list/scalar node, typically ``args.optimizer``.
        *args: Positional arguments for the top-level component.
        **kwargs: Keyword arguments for the top-level component (e.g. ``params=...``).

    Returns:
        The built object.

    Raises:
        ConfigError: If a ``_component_`` does not resolve, an interpolation fails, or the
            arguments do not bind; the message names the config path of the node.
    """
    path = ""
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            path = node._get_full_key(None) or ""
        except Exception:  # A private omegaconf helper: a missing path only costs context.
            path = ""
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"{path or 'config'}: {first_line(err)}") from err
    if isinstance(node, dict) and COMPONENT_KEY in node:
        return _call(node, path, args, kwargs)
    if args or kwargs:
        raise ConfigError(
            f"{path or 'config'}: arguments given but the node has no {COMPONENT_KEY}"
        )
    return _build(node, path)
