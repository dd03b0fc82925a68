"""``router.aux_loss_coef``: a weight the SFT recipes use; the other recipes have no ``router:``."""

import pytest

from tunelab import ConfigError
from tunelab.cli._check import check_config


@pytest.mark.parametrize("config", ["tiny/lora", "tiny/full", "tiny/moe_lora"])
def test_sft_recipes_take_a_router_loss_weight(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_config(config, ["router.aux_loss_coef=0.01"])
    with pytest.raises(ConfigError, match=r"router\.aux_loss_coef"):
        check_config(config, ["router.aux_loss_coef=-1"])


@pytest.mark.parametrize(
    "config, recipe", [("tiny/lora_dpo", "lora_dpo_distributed"), ("tiny/grpo", "grpo_distributed")]
)
def test_recipes_without_the_router_term_refuse_a_weight(config, recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The recipe's settings have no router section, so the key is unknown (not a special case).
    with pytest.raises(ConfigError, match="unknown key 'router' in config"):
        check_config(config, ["router.aux_loss_coef=0.01"])
    assert recipe in str(check_config(config, [])[1])
