"""Qwen2.5-VL LoRA SFT end to end: the shipped ``tiny/vl_lora`` on the embedded tiny random
vision-language model and its generated images, through the real ``tunelab run``.

Two processes equal one process with twice the accumulation, a kill-and-resume on two
processes is exact, and the export loads in transformers (merged) and PEFT (adapter) with our
logits on an image row.
"""

import json

import pytest
import torch

from tests.recipes.conftest import (
    assert_same_exports,
    interrupted_copy,
    losses_by_step,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY_VL = assets_dir() / "tiny_vl"
STEPS = 4
SETTINGS = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]


def _run(out, *extra, nproc=2, batch=2, accumulation=1):
    return tunelab_run(
        "lora_finetune_distributed", "tiny/vl_lora", f"output_dir={out}", *SETTINGS,
        f"schedule.batch_size={batch}", f"schedule.gradient_accumulation_steps={accumulation}",
        *extra, nproc=nproc,
    )  # fmt: skip


@pytest.fixture(scope="module")
def vl_2p(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl") / "2p"
    _run(out)
    return out


def test_two_processes_equal_one_with_twice_the_accumulation(vl_2p, tmp_path):
    _run(tmp_path / "1p", nproc=1, accumulation=2)
    two, one = losses_by_step(vl_2p), losses_by_step(tmp_path / "1p")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])
    assert two[STEPS] < two[1]  # it learns


def test_exact_resume_on_two_processes(vl_2p, tmp_path):
    out = interrupted_copy(vl_2p, tmp_path / "run", after_step=2)
    _run(out, "checkpoint.resume_from_checkpoint=true")
    resumed, reference = losses_by_step(out), losses_by_step(vl_2p)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[step] == reference[step] for step in (3, 4)), (resumed, reference)
    assert_same_exports(out, vl_2p)


def test_export_loads_in_transformers_and_peft(vl_2p):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from PIL import Image

    from tunelab.data import load_tokenizer
    from tunelab.data.image_dataset import image_processing_for
    from tunelab.models import load_pretrained

    export = vl_2p / "epoch_0"
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
