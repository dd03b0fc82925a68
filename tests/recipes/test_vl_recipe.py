"""Vision-language LoRA SFT end to end through the real ``tunelab run``: the shipped
``tiny/vl_lora`` (Qwen2.5-VL), ``tiny/qwen3_vl_lora`` (Qwen3-VL: deepstack, interleaved
M-RoPE, a learned position table) and ``tiny/gemma3_vl_lora`` (Gemma 3: SigLIP tower, pooled
soft tokens, bidirectional image blocks) on the embedded tiny random models and their
generated images.

For each family two processes equal one process with twice the accumulation and a
kill-and-resume on two processes is exact, and likewise for a full fine-tune of Gemma 3 and of
Qwen3-VL (``full_finetune_distributed``: tower, projector and language model trained whole,
saved and restored through FSDP2; Qwen3-VL's deepstack mergers too). The Qwen3-VL runs train the tower and projector whole
beside the adapters (``model.vision_tower: full``, ``model.projector: full``), so FSDP2 shards,
gathers, saves and restores them too; one run serves the 2 = 1 comparison, the resume and the
export checks. Exports load in transformers (merged) and PEFT (adapter) with our logits on an
image row.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_VL = assets_dir() / "tiny_vl"
TINY_QWEN3_VL = assets_dir() / "tiny_qwen3_vl"
STEPS = 4
SETTINGS = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]
# run -> its recipe, config and the overrides its runs add
LORA = "lora_finetune_distributed"
RUNS = {
    "qwen2_5_vl": (LORA, "tiny/vl_lora", []),
    "qwen3_vl": (LORA, "tiny/qwen3_vl_lora", ["model.vision_tower=full", "model.projector=full"]),
    "gemma3": (LORA, "tiny/gemma3_vl_lora", []),
    # full fine-tuning: the SigLIP tower, projector and language model all trained whole
    "gemma3_full": (
        "full_finetune_distributed",
        "tiny/gemma3_vl_lora",
        ["~lora", "optimizer.lr=1e-3"],
    ),
    "qwen3_vl_full": (
        "full_finetune_distributed",
        "tiny/qwen3_vl_lora",
        ["~lora", "optimizer.lr=1e-3"],
    ),
}


def _weights(folder):
    """Every tensor of a model folder's safetensors files."""
    weights = {}
    for path in folder.glob("*.safetensors"):
        weights |= load_file(path)
    return weights


def _run(family, out, *extra, nproc=2, batch=2, accumulation=1):
    recipe, config, overrides = RUNS[family]
    return tunelab_run(
        recipe, config, f"output_dir={out}", *SETTINGS, *overrides,
        f"schedule.batch_size={batch}", f"schedule.gradient_accumulation_steps={accumulation}",
        *extra, nproc=nproc,
    )  # fmt: skip


@pytest.fixture(scope="module")
def qwen2_5_vl_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "2p"
    _run("qwen2_5_vl", out)
    return out


@pytest.fixture(scope="module")
def qwen3_vl_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl") / "2p"
    _run("qwen3_vl", out)
    return out


@pytest.fixture(scope="module")
def gemma3_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_vl") / "2p"
    _run("gemma3", out)
    return out


@pytest.fixture(scope="module")
def gemma3_full_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_vl_full") / "2p"
    _run("gemma3_full", out)
    return out


@pytest.fixture(scope="module")
def qwen3_vl_full_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl_full") / "2p"
    _run("qwen3_vl_full", out)
    return out


@pytest.mark.parametrize("family", sorted(RUNS))
def test_two_processes_equal_one_with_twice_the_accumulation(family, request, tmp_path):
    two_dir = request.getfixturevalue(f"{family}_2p")
    _run(family, tmp_path / "1p", nproc=1, accumulation=2)
    two, one = losses_by_step(two_dir), losses_by_step(tmp_path / "1p")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])
    assert two[STEPS] < two[1]  # it learns


@pytest.mark.parametrize("family", sorted(RUNS))
def test_exact_resume_on_two_processes(family, request, tmp_path):
    reference_dir = request.getfixturevalue(f"{family}_2p")
    out = interrupted_copy(reference_dir, tmp_path / "run", after_step=2)
    _run(family, out, "checkpoint.resume_from_checkpoint=true")
    resumed, reference = losses_by_step(out), losses_by_step(reference_dir)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[step] == reference[step] for step in (3, 4)), (resumed, reference)
    assert_same_exports(out, reference_dir)


def test_export_loads_in_transformers_and_peft(qwen2_5_vl_2p):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from PIL import Image

    from tunelab.data import load_tokenizer
    from tunelab.data.image_dataset import image_processing_for
    from tunelab.models import load_pretrained

    export = qwen2_5_vl_2p / "epoch_0"
    assert (export / "preprocessor_config.json").is_file()
    tokenizer = load_tokenizer(export)
    processing = image_processing_for(tokenizer)
    pixels, grid = processing(Image.open(TINY_VL / "images" / "red_circle_1.png"))
    image_token = tokenizer.token_to_id("<|image_pad|>")
    count = grid[1] * grid[2] // 4
    ids = tokenizer.encode("<|im_start|>user\n<|vision_start|>", add_bos=False)
    ids += [image_token] * count
    ids += tokenizer.encode("<|vision_end|>What colour is the shape?<|im_end|>\n", add_bos=False)
    tokens = torch.tensor([ids])
    kwargs = dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    with torch.no_grad():
        ours = load_pretrained(export)(tokens, **kwargs)

    def hf(path):
        return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    hf_kwargs = dict(input_ids=tokens, mm_token_type_ids=(tokens == image_token).int(), **kwargs)
    adapted = peft.PeftModel.from_pretrained(hf(TINY_VL), export / "adapter").eval()
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert not any("visual" in name for name in config["target_modules"])
    with torch.no_grad():
        merged = hf(export)(**hf_kwargs).logits
        assert float((merged - ours).abs().max()) <= 1e-5
        assert float((adapted(**hf_kwargs).logits - ours).abs().max()) <= 1e-5
        assert float((hf(TINY_VL)(**hf_kwargs).logits - ours).abs().max()) > 1e-3


def test_qwen3_vl_tower_and_projector_trained_whole_export_as_modules_to_save(qwen3_vl_2p):
    """``model.vision_tower: full`` and ``model.projector: full`` in the Qwen3-VL LoRA run:
    every tower and merger weight trains beside the adapters, the adapter carries them as
    PEFT's ``modules_to_save``, and PEFT on transformers' base model gives the merged export's
    logits."""
    transformers = pytest.importorskip("transformers", minversion="5")
    peft = pytest.importorskip("peft")
    from tests.interop.vl_checks import TOLERANCE, VLSpec

    export = qwen3_vl_2p / "epoch_0"
    base, new = _weights(TINY_QWEN3_VL), _weights(export)
    for prefix in ("model.visual.", "model.language_model.layers.0.self_attn.q_proj."):
        keys = {key for key in base if key.startswith(prefix)}
        unchanged = {key for key in keys if torch.equal(base[key], new[key])}
        assert keys and not unchanged, sorted(unchanged)[:3]
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == [
        "visual.patch_embed", "visual.pos_embed", "visual.blocks.0", "visual.blocks.1",
        "visual.merger", "visual.deepstack_merger_list.0",
    ]  # fmt: skip
    model_config = json.loads((TINY_QWEN3_VL / "config.json").read_text())
    spec = VLSpec(
        transformers.Qwen3VLForConditionalGeneration,
        model_config["image_token_id"],
        model_config["vision_start_token_id"],
        model_config["vision_end_token_id"],
        patch=16,
    )
    grids = [(1, 4, 6)]
    tokens = torch.tensor([spec.row(grids)])
    inputs = spec.hf_inputs(tokens, spec.images(grids))
    adapted = peft.PeftModel.from_pretrained(spec.load_hf(TINY_QWEN3_VL), export / "adapter")
    with torch.no_grad():
        merged = spec.load_hf(export)(**inputs).logits
        assert float((adapted.eval()(**inputs).logits - merged).abs().max()) <= TOLERANCE
        assert float((spec.load_hf(TINY_QWEN3_VL)(**inputs).logits - merged).abs().max()) > 1e-3
