"""Gemma 3 multimodal LoRA SFT end to end: the shipped ``tiny/gemma3_vl_lora`` on the embedded
tiny random Gemma 3 (SigLIP tower, pooled soft tokens, bidirectional image blocks) and
``tiny/vl_lora``'s generated images, through the real ``tunelab run`` on 2 processes.

One run serves every test here: the loss falls and only the language model's adapted weights
move; the export (hub key layout, preprocessing files beside it) loads in transformers
(merged) and its adapter in PEFT, both with our logits on a chat row with an image made by the
training data path.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import losses_by_step, tunelab_run
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_GEMMA3_VL = assets_dir() / "tiny_gemma3_vl"
TINY_VL = assets_dir() / "tiny_vl"
STEPS = 4


def _weights(folder):
    """Every tensor of a model folder's safetensors files."""
    weights = {}
    for path in folder.glob("*.safetensors"):
        weights |= load_file(path)
    return weights


@pytest.fixture(scope="module")
def gemma3_vl_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_vl") / "2p"
    tunelab_run(
        "lora_finetune_distributed", "tiny/gemma3_vl_lora", f"output_dir={out}",
        "schedule.epochs=1", f"schedule.max_steps_per_epoch={STEPS}",
        "lr_scheduler.num_warmup_steps=0", "schedule.batch_size=2",
        "checkpoint.save_every_n_steps=2", nproc=2,
    )  # fmt: skip
    return out


def test_the_loss_falls_and_only_the_language_model_moves(gemma3_vl_2p):
    losses = losses_by_step(gemma3_vl_2p)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    assert losses[STEPS] < losses[1], losses
    base, new = _weights(TINY_GEMMA3_VL), _weights(gemma3_vl_2p / "epoch_0")
    assert set(new) == set(
        base
    )  # the hub's layout: language_model.model.*, vision_tower.vision_model.*
    frozen = [key for key in base if key.startswith(("vision_tower.", "multi_modal_projector."))]
    assert frozen and all(torch.equal(base[key], new[key]) for key in frozen)
    adapted = [key for key in base if ".self_attn.q_proj." in key and "language_model" in key]
    assert adapted and not any(torch.equal(base[key], new[key]) for key in adapted)


def test_export_loads_in_transformers_and_peft(gemma3_vl_2p):
    transformers = pytest.importorskip("transformers", minversion="5")
    peft = pytest.importorskip("peft")

    from tunelab.data import load_tokenizer
    from tunelab.data.chat import chat_template_of
    from tunelab.data.image_dataset import ImageCollate, image_processing_for
    from tunelab.data.image_rows import ImageChatRows
    from tunelab.models import load_pretrained

    export = gemma3_vl_2p / "epoch_0"
    for name in ("preprocessor_config.json", "processor_config.json"):
        assert (export / name).is_file()
    tokenizer = load_tokenizer(export)
    processing = image_processing_for(tokenizer)
    rows = ImageChatRows(
        tokenizer=tokenizer,
        template=chat_template_of(tokenizer),
        column="messages",
        processing=processing,
        image_dir=str(TINY_VL),
    )
    question = [
        {"type": "image", "image": "images/red_circle_1.png"},
        {"type": "text", "text": "What colour is the shape?"},
    ]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "Red."}]
    (sample,) = rows({"messages": messages})
    batch = ImageCollate(processing)([sample], pad_id=0)
    tokens, pixels = batch["tokens"], batch["pixel_values"]
    image_token = tokenizer.token_to_id(processing.image_token)
    assert int((tokens == image_token).sum()) == processing.tokens_per_image
    with torch.no_grad():
        ours = load_pretrained(export)(tokens, pixel_values=pixels)

    def hf(path):
        return transformers.Gemma3ForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    hf_kwargs = dict(
        input_ids=tokens, pixel_values=pixels, token_type_ids=(tokens == image_token).long()
    )
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    # Each adapted module named by transformers' path: never SigLIP's like-named linears.
    assert config["target_modules"] and all(
        name.startswith("language_model.layers.") for name in config["target_modules"]
    )
    adapted = peft.PeftModel.from_pretrained(hf(TINY_GEMMA3_VL), export / "adapter").eval()
    with torch.no_grad():
        merged = hf(export)(**hf_kwargs).logits
        assert float((merged - ours).abs().max()) <= 1e-5
        assert float((adapted(**hf_kwargs).logits - ours).abs().max()) <= 1e-5
        assert float((hf(TINY_GEMMA3_VL)(**hf_kwargs).logits - ours).abs().max()) > 1e-3
