"""``model.vision_tower`` / ``model.projector``: which parts of a vision-language model train."""

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.config.lora import LoRAArgs
from tunelab.config.sections import LoRASFTModelSetupArgs, SFTModelSetupArgs
from tunelab.errors import ConfigError
from tunelab.peft.apply import lora_modules
from tunelab.training import build_model

TINY_VL = assets_dir() / "tiny_vl"
TINY = assets_dir() / "tiny"
CPU = torch.device("cpu")
TOWER = ("visual.patch_embed.", "visual.blocks.")
PROJECTOR = "visual.merger."
LORA = LoRAArgs(rank=2, alpha=4.0, targets=["q_proj", "v_proj"])


def _part(name: str) -> str:
    if name.startswith(TOWER):
        return "tower"
    return "projector" if name.startswith(PROJECTOR) else "language"


def _trainable(model: torch.nn.Module) -> dict[str, set[str]]:
    """Trainable parameter names by part; LoRA factors count as ``lora`` of their part."""
    parts: dict[str, set[str]] = {"tower": set(), "projector": set(), "language": set()}
    for name, param in model.named_parameters():
        if param.requires_grad:
            parts[_part(name)].add(name)
    return parts


def _linears(model: torch.nn.Module, part: str) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and _part(name) == part and ".lora_" not in name
    }


@pytest.mark.parametrize("tower", ["frozen", "lora", "full"])
@pytest.mark.parametrize("projector", ["frozen", "lora", "full"])
def test_lora_adapts_exactly_the_parts_asked(tower, projector):
    section = LoRASFTModelSetupArgs(path=str(TINY_VL), vision_tower=tower, projector=projector)
    model = build_model(section, device=CPU, lora=LORA)
    adapted = set(lora_modules(model))
    trainable = _trainable(model)
    # What a LoRA export's adapter carries whole (PEFT's modules_to_save): each block apart.
    whole = {
        "tower": ["visual.patch_embed", "visual.blocks.0", "visual.blocks.1"],
        "projector": ["visual.merger"],
    }
    assert model.peft_modules_to_save() == [
        *(whole["tower"] if tower == "full" else []),
        *(whole["projector"] if projector == "full" else []),
    ]
    for part, how in (("tower", tower), ("projector", projector)):
        in_part = {name for name in adapted if _part(name) == part}
        if how == "full":
            # Every weight of the part trains, beside the adapters, and none is adapted.
            every = {name for name, _ in model.named_parameters() if _part(name) == part}
            assert not in_part and every and trainable[part] == every
        elif how == "lora":
            # Every linear layer of the part is adapted (the tower's qkv, proj, mlp...), and
            # only its LoRA factors train.
            assert in_part and not _linears(model, part)
            assert trainable[part] == {
                f"{name}.{child}.weight" for name in in_part for child in ("lora_A", "lora_B")
            }
        else:
            assert not in_part and not trainable[part]
    language = {name for name in adapted if _part(name) == "language"}
    assert language and {name.rpartition(".")[2] for name in language} == {"q_proj", "v_proj"}
    assert all(".lora_" in name for name in trainable["language"])


@pytest.mark.parametrize("tower", ["frozen", "full"])
@pytest.mark.parametrize("projector", ["frozen", "full"])
def test_full_fine_tuning_trains_exactly_the_parts_asked(tower, projector):
    section = SFTModelSetupArgs(path=str(TINY_VL), vision_tower=tower, projector=projector)
    model = build_model(section, device=CPU)
    names = {part: set() for part in ("tower", "projector", "language")}
    for name, _ in model.named_parameters():
        names[_part(name)].add(name)
    trainable = _trainable(model)
    assert not lora_modules(model)
    assert trainable["language"] == names["language"]
    assert trainable["tower"] == (names["tower"] if tower == "full" else set())
    assert trainable["projector"] == (names["projector"] if projector == "full" else set())
    assert names["tower"] and names["projector"]


@pytest.mark.parametrize(
    ("section", "lora", "key"),
    [
        (LoRASFTModelSetupArgs(path=str(TINY), vision_tower="lora"), LORA, "vision_tower"),
        (SFTModelSetupArgs(path=str(TINY), projector="frozen"), None, "projector"),
    ],
)
def test_a_text_only_model_refuses_vision_settings(section, lora, key):
    with pytest.raises(ConfigError) as error:
        build_model(section, device=CPU, lora=lora)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"model.{key}:")
    assert "has no vision tower" in message


def test_defaults_on_a_text_only_model_build():
    assert build_model(SFTModelSetupArgs(path=str(TINY)), device=CPU) is not None
