"""`_component_` instantiation."""

import datetime
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from tunelab.config import import_component, instantiate
from tunelab.errors import ConfigError

COMPONENTS = """
class Pair:
    def __init__(self, left, right=0):
        self.left = left
        self.right = right

    @classmethod
    def doubled(cls, value):
        return cls(value, value)


def add(a, b=1):
    return a + b
"""


@pytest.fixture(autouse=True)
def components(tmp_path, monkeypatch):
    (tmp_path / "tl_components.py").write_text(textwrap.dedent(COMPONENTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("tl_components", None)


def test_function_with_config_args():
    assert instantiate(OmegaConf.create({"_component_": "tl_components.add", "a": 2, "b": 5})) == 7


def test_class_and_classmethod():
    pair = instantiate({"_component_": "tl_components.Pair.doubled", "value": 3})
    assert (type(pair).__name__, pair.left, pair.right) == ("Pair", 3, 3)
    assert import_component("datetime.timedelta") is datetime.timedelta


def test_recursive_through_dicts_and_lists():
    cfg = OmegaConf.create(
        {
            "_component_": "tl_components.Pair",
            "left": {"_component_": "tl_components.add", "a": 1, "b": 2},
            "right": [{"_component_": "tl_components.add", "a": 10}, {"plain": 4}, 5],
        }
    )
    pair = instantiate(cfg)
    assert pair.left == 3
    assert pair.right == [11, {"plain": 4}, 5]
    assert isinstance(pair.right[1], dict)


def test_call_site_kwargs_win_and_positional_args():
    node = OmegaConf.create({"_component_": "tl_components.add", "a": 1, "b": 2})
    assert instantiate(node, b=100) == 101
    assert instantiate({"_component_": "tl_components.add", "b": 2}, 40) == 42


def test_real_optimizer_with_interpolation():
    cfg = OmegaConf.create(
        {"base_lr": 0.5, "optimizer": {"_component_": "torch.optim.SGD", "lr": "${base_lr}"}}
    )
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = instantiate(cfg.optimizer, params=[param])
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_plain_nodes_become_python_containers():
    cfg = OmegaConf.create({"a": [1, {"b": 2}]})
    built = instantiate(cfg)
    assert built == {"a": [1, {"b": 2}]}
    assert type(built) is dict and type(built["a"]) is list
    assert instantiate(None) is None


def test_unknown_component_names_config_path():
    cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamWW", "lr": 1.0}})
    with pytest.raises(ConfigError) as info:
        instantiate(cfg.optimizer, params=[])
    message = str(info.value)
    assert message.startswith("optimizer._component_: cannot import 'torch.optim.AdamWW'")
    assert "did you mean 'torch.optim.AdamW'" in message


def test_missing_module_and_bad_path():
    with pytest.raises(ConfigError, match="no module named 'nosuchpkg'"):
        import_component("nosuchpkg.mod.Thing")
    with pytest.raises(ConfigError, match="expected a dotted path"):
        import_component("add")
    with pytest.raises(ConfigError, match="expected a dotted path"):
        import_component(3)


def test_nested_error_names_nested_path():
    cfg = OmegaConf.create(
        {
            "model": {
                "_component_": "tl_components.Pair",
                "left": {"_component_": "tl_components.nope"},
            }
        }
    )
    with pytest.raises(
        ConfigError, match=r"^model\.left\._component_: .*'tl_components' has no attribute 'nope'"
    ):
        instantiate(cfg.model)


def test_unbound_arguments_name_the_node():
    cfg = OmegaConf.create({"thing": {"_component_": "tl_components.add", "a": 1, "c": 3}})
    with pytest.raises(ConfigError, match=r"^thing: cannot call tl_components.add .*'c'"):
        instantiate(cfg.thing)


def test_broken_interpolation_is_a_config_error():
    cfg = OmegaConf.create({"thing": {"_component_": "tl_components.add", "a": "${nope}"}})
    with pytest.raises(ConfigError, match="nope"):
        instantiate(cfg.thing)
