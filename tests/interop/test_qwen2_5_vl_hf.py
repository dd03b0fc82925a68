"""Qwen2.5-VL in tunelab's own modules against transformers' ``Qwen2_5_VLForConditionalGeneration``.

One tiny random checkpoint, saved by transformers: window attention (windows of 2 x 2 merge
squares, so images of 4 x 6 and more merge squares hold several windows, edge windows
smaller), one full-attention block, GQA, M-RoPE sections 2/3/3. Logits agree within 1e-4 on
the same pixel values and ids for several image sizes and aspect ratios, two images in one
row, a text-only row, and an export that transformers loads back.
"""

import json

import pytest
import torch

from tunelab.models import load_pretrained
from tunelab.models.vision_language import VisionLanguageDecoder, multimodal_positions

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    # Measured on 4.56 (the floor): no PIL Qwen2-VL image processor module, and the tiny
    # Qwen2_5_VLConfig built from a text_config dict fails to load ('NoneType' not subscriptable).
    pytest.skip(
        f"Qwen2.5-VL interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )

TOLERANCE = 1e-5  # fp32; the issue asks 1e-4, measured ~2e-7
IMAGE, VIDEO, START, END = 290, 291, 292, 293
PATCH, MERGE = 14, 2


def tiny_qwen2_5_vl_config() -> "transformers.Qwen2_5_VLConfig":
    """A 2-layer language model and a 3-block vision tower (block 1 attends fully)."""
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            window_size=56,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config())
    # transformers initialises the norms to one and the biases to zero: randomise them so a
    # mixed-up norm or bias shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tiny_vl_dir):
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_vl_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return hf_model, load_pretrained(tiny_vl_dir)


def _row(grids: list[tuple[int, int, int]], text: int = 5, seed: int = 0) -> list[int]:
    """Text, then each image as start, its tokens and end, then text."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 280, (text,), generator=generator).tolist()
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
        ids += torch.randint(0, 280, (3,), generator=generator).tolist()
    return ids


def _pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(
        patches, 3 * 2 * PATCH * PATCH, generator=torch.Generator().manual_seed(seed)
    )


def _compare(models, rows_grids: list[list[tuple[int, int, int]]]) -> float:
    hf_model, model = models
    rows = [_row(grids, seed=i) for i, grids in enumerate(rows_grids)]
    length = max(map(len, rows))
    # Right padding: causal attention keeps the padding out of the real tokens' logits.
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])
    lengths = [len(row) for row in rows]
    grids = [grid for row_grids in rows_grids for grid in row_grids]
    kwargs = {}
    if grids:
        kwargs = dict(pixel_values=_pixels(grids), image_grid_thw=torch.tensor(grids))
    with torch.no_grad():
        ours = model(tokens, **kwargs)
        theirs = hf_model(
            input_ids=tokens,
            mm_token_type_ids=(tokens == IMAGE).int(),
            **kwargs,
        ).logits
    return max(float((ours[i, :n] - theirs[i, :n]).abs().max()) for i, n in enumerate(lengths))


def test_loads_as_vision_language_model(models):
    _, model = models
    assert isinstance(model, VisionLanguageDecoder)
    assert model.args.family == "qwen2_5_vl"
    assert model.args.mrope_section == [2, 3, 3]
    assert model.args.vision.full_attention_blocks == [1]
    assert model.args.vision.image_token_id == IMAGE


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 4, 4)],  # one window
        [(1, 8, 12)],  # 2 x 3 windows
        [(1, 14, 6)],  # tall, edge windows of one merge row
        [(1, 6, 10)],  # wide, edge windows on both sides
    ],
    ids=["square", "windows", "tall", "wide"],
)
def test_one_image_logits_match_transformers(models, grids):
    assert _compare(models, [grids]) <= TOLERANCE


def test_two_images_in_one_row_and_a_second_row(models):
    """Two images of different shapes in row 0, another image in row 1 (right-padded)."""
    assert _compare(models, [[(1, 6, 4), (1, 4, 10)], [(1, 8, 8)]]) <= TOLERANCE


def test_text_only_row_matches_transformers(models):
    assert _compare(models, [[]]) <= TOLERANCE


def test_the_image_changes_the_logits(models):
    """A test that cannot fail is a defect: other pixels give other logits after the image."""
    _, model = models
    grids = [(1, 4, 4)]
    tokens = torch.tensor([_row(grids)])
    with torch.no_grad():
        a = model(tokens, pixel_values=_pixels(grids, 0), image_grid_thw=torch.tensor(grids))
        b = model(tokens, pixel_values=_pixels(grids, 1), image_grid_thw=torch.tensor(grids))
    assert float((a[0, -1] - b[0, -1]).abs().max()) > 1e-3


def test_image_tokens_without_pixels_are_refused(models):
    """A batch collated without its images would train image tokens as text: refused."""
    _, model = models
    with pytest.raises(ValueError, match="no pixel_values"):
        model(torch.tensor([_row([(1, 4, 4)])]))


def test_positions_follow_the_image_grid():
    """Hand-checked M-RoPE positions: 2 text, start, a 2 x 3 merged grid, end, 1 text."""
    tokens = torch.tensor([[7, 8, START] + [IMAGE] * 6 + [END, 9]])
    positions = multimodal_positions(tokens, torch.tensor([[1, 4, 6]]), IMAGE, MERGE)
    assert positions[0, 0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7]
    assert positions[1, 0].tolist() == [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7]
    assert positions[2, 0].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]


def test_packed_documents_restart_positions():
    tokens = torch.tensor([[7, START] + [IMAGE] * 4 + [END, 8, START] + [IMAGE] * 4 + [END]])
    document_ids = torch.tensor([[0] * 8 + [1] * 6])
    grids = torch.tensor([[1, 4, 4], [1, 4, 4]])
    packed = multimodal_positions(tokens, grids, IMAGE, MERGE, document_ids)
    alone = multimodal_positions(tokens[:, 8:], grids[1:], IMAGE, MERGE)
    assert torch.equal(packed[:, :, 8:], alone)
    assert packed[0, 0, :8].tolist() == [0, 1, 2, 2, 2, 2, 4, 5]


def test_export_loads_in_transformers_with_equal_logits(models, tmp_path):
    """Our hub-layout weights and our own config.json load in transformers, logits equal, and
    the config parses back to the same arguments."""
    from tunelab.checkpoint.hf_sharded import save_hf_sharded
    from tunelab.models import from_hf_config

    _, model = models
    adapter = model.state_dict_adapter
    save_hf_sharded(adapter.to_hf(model.state_dict()), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(torch.float32)))
    assert from_hf_config(tmp_path).args == model.args
    reloaded, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    grids = [(1, 6, 8)]
    tokens = torch.tensor([_row(grids)])
    kwargs = dict(pixel_values=_pixels(grids), image_grid_thw=torch.tensor(grids))
    with torch.no_grad():
        ours = model(tokens, **kwargs)
        theirs = reloaded.eval()(
            input_ids=tokens, mm_token_type_ids=(tokens == IMAGE).int(), **kwargs
        ).logits
    assert float((ours - theirs).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("vision", [(), ("visual.blocks.", "visual.merger.")])
def test_lora_export_loads_in_peft_and_transformers(tiny_vl_dir, tmp_path, vision):
    """LoRA on every linear layer of the language model (the tower frozen, or with
    ``model.vision_tower: lora`` and ``model.projector: lora`` every linear layer of the
    tower's blocks and of the projector adapted too), exported by ``export_hf`` as the
    recipes do: PEFT loads the adapter onto transformers' model, and transformers the merged
    weights, both with our logits on an image row."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from tunelab.checkpoint.export import ADAPTER_DIR_NAME, export_hf
    from tunelab.config.lora import LoRAArgs
    from tunelab.peft import apply_lora, get_adapter_params

    model = load_pretrained(tiny_vl_dir)
    lora = LoRAArgs(targets=["all-linear"], rank=4, alpha=8.0)
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    swapped = apply_lora(model, lora, adapt_under=vision)
    in_tower = {name for name in swapped if name.startswith("visual.")}
    assert in_tower == {name for name in linears if name.startswith(vision)}
    assert bool(in_tower) == bool(vision)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_(std=0.2)
    grids = [(1, 6, 8)]
    tokens = torch.tensor([_row(grids)])
    kwargs = dict(pixel_values=_pixels(grids), image_grid_thw=torch.tensor(grids))
    hf_kwargs = dict(input_ids=tokens, mm_token_type_ids=(tokens == IMAGE).int(), **kwargs)
    with torch.no_grad():
        expected = model(tokens, **kwargs)
    export = export_hf(model, tmp_path / "epoch_0", base_checkpoint_dir=tiny_vl_dir, lora=lora)

    def hf(path):
        return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    adapter_dir = export / ADAPTER_DIR_NAME
    adapted = peft.PeftModel.from_pretrained(hf(tiny_vl_dir), adapter_dir).eval()
    theirs = peft.get_peft_model_state_dict(adapted, save_embedding_layers=False)
    # PEFT adapted exactly our modules (none of the tower's like-named linears), and every
    # weight it holds was in our file.
    assert set(theirs) == set(load_file(adapter_dir / "adapter_model.safetensors"))
    assert len(theirs) == 2 * len(swapped)
    # And the adapter reads back into a fresh LoRA model here (as adapter_dir does).
    from tunelab.peft import load_peft_adapter

    fresh = load_pretrained(tiny_vl_dir)
    reread = LoRAArgs.from_peft_config(
        json.loads((adapter_dir / "adapter_config.json").read_text())
    )
    assert sorted(apply_lora(fresh, reread)) == sorted(swapped)
    load_peft_adapter(fresh, adapter_dir)
    with torch.no_grad():
        assert float((fresh(tokens, **kwargs) - expected).abs().max()) == 0.0
        assert float((adapted(**hf_kwargs).logits - expected).abs().max()) <= TOLERANCE
        merged = hf(export)(**hf_kwargs).logits
        assert float((merged - expected).abs().max()) <= TOLERANCE
        base = hf(tiny_vl_dir)(**hf_kwargs).logits
        assert float((base - expected).abs().max()) > 1e-2
