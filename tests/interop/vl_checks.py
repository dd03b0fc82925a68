"""Checks every vision-language family's interop tests share (Qwen2.5-VL, Qwen3-VL, Gemma 3).

Rows of random text with images as ``start, image tokens, end``, random pixel values, and
the comparisons against transformers: logits, a merged export, and a LoRA export loaded by
PEFT. Each family's test file builds its tiny checkpoint and calls these.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tunelab.assets.build_tiny_vl import SPECIALS

TOLERANCE = 1e-5  # fp32; the issue asks 1e-4, measured ~2e-7


def write_chat_tokenizer(path: Path, text: str, template: str) -> None:
    """A byte-level BPE of 300 tokens trained on ``text``, Qwen's specials, into ``path``.

    Writes ``tokenizer.json`` and a ``tokenizer_config.json`` with ``template`` as its chat
    template (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos). The same text gives the same
    ids, which the recorded video rows depend on.
    """
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        [text] * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class VLSpec:
    """A tiny vision-language checkpoint's token ids and patch shape, and its HF class."""

    hf_class: type
    """transformers' ``...ForConditionalGeneration`` class."""
    image: int
    """The image token."""
    start: int
    """The token before an image."""
    end: int
    """The token after an image."""
    patch: int
    """Patch side, in pixels."""
    merge: int = 2
    """Side of the square of patches that makes one image token."""

    def row(self, grids: list[tuple[int, int, int]], text: int = 5, seed: int = 0) -> list[int]:
        """Text, then each image as start, its tokens and end, then text."""
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 280, (text,), generator=generator).tolist()
        for t, h, w in grids:
            ids += [self.start] + [self.image] * (t * h * w // self.merge**2) + [self.end]
            ids += torch.randint(0, 280, (3,), generator=generator).tolist()
        return ids

    def pixels(self, grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
        """Random pixel values for images of these patch grids (2 frames per patch)."""
        patches = sum(t * h * w for t, h, w in grids)
        return torch.randn(
            patches, 3 * 2 * self.patch**2, generator=torch.Generator().manual_seed(seed)
        )

    def images(self, grids: list[tuple[int, int, int]], seed: int = 0) -> dict:
        """Our forward's image arguments (empty for no images)."""
        if not grids:
            return {}
        return dict(pixel_values=self.pixels(grids, seed), image_grid_thw=torch.tensor(grids))

    def hf_inputs(self, tokens: torch.Tensor, images: dict) -> dict:
        """transformers' forward arguments for the same inputs."""
        return dict(input_ids=tokens, mm_token_type_ids=(tokens == self.image).int(), **images)

    def load_hf(self, path: Path):
        """transformers' model from a folder, fp32, eager attention, in eval mode."""
        return self.hf_class.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()


def save_tiny_checkpoint(model: torch.nn.Module, folder: Path) -> Path:
    """Save a tiny transformers model, its norms and biases randomised first.

    transformers initialises the norms to one and the biases to zero: random ones make a
    mixed-up norm or bias show in the logits.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name or "projection" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    return folder


def max_logit_gap(spec: VLSpec, models, rows_grids: list[list[tuple[int, int, int]]]) -> float:
    """The largest logit difference over the real tokens of right-padded rows."""
    hf_model, model = models
    rows = [spec.row(grids, seed=i) for i, grids in enumerate(rows_grids)]
    length = max(map(len, rows))
    # Right padding: causal attention keeps the padding out of the real tokens' logits.
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])
    images = spec.images([grid for row_grids in rows_grids for grid in row_grids])
    with torch.no_grad():
        ours = model(tokens, **images)
        theirs = hf_model(**spec.hf_inputs(tokens, images)).logits
    lengths = [len(row) for row in rows]
    return max(float((ours[i, :n] - theirs[i, :n]).abs().max()) for i, n in enumerate(lengths))


def check_merged_export(spec: VLSpec, model, folder: Path) -> None:
    """Our hub-layout weights and our own config.json load in transformers with no missing or
    unexpected keys and equal logits, and the config parses back to the same arguments."""
    from tunelab.checkpoint.hf_sharded import save_hf_sharded
    from tunelab.models import from_hf_config

    adapter = model.state_dict_adapter
    save_hf_sharded(adapter.to_hf(model.state_dict()), folder)
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(torch.float32)))
    assert from_hf_config(folder).args == model.args
    reloaded, info = spec.hf_class.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    grids = [(1, 6, 8)]
    tokens = torch.tensor([spec.row(grids)])
    images = spec.images(grids)
    with torch.no_grad():
        ours = model(tokens, **images)
        theirs = reloaded.eval()(**spec.hf_inputs(tokens, images)).logits
    assert float((ours - theirs).abs().max()) <= TOLERANCE


def check_lora_export(
    spec: VLSpec,
    model_dir: Path,
    folder: Path,
    vision: tuple[str, ...],
    full: tuple[str, ...] = (),
) -> None:
    """LoRA on every linear layer of the language model, and of the tower parts ``vision``
    names (the ``adapt_under`` prefixes of ``model.vision_tower: lora`` and
    ``model.projector: lora``), exported by ``export_hf`` as the recipes do: PEFT loads the
    adapter onto transformers' model, transformers the merged weights, and tunelab the
    adapter back, all with our logits on an image row.

    ``full`` names parts trained whole beside the adapters (``model.vision_tower: full``):
    their weights are moved, and the adapter carries them as PEFT's ``modules_to_save``
    (tunelab does not read such an adapter back: PEFT and the merged export are checked).
    """
    import peft
    from safetensors.torch import load_file

    from tunelab.checkpoint.export import ADAPTER_DIR_NAME, export_hf
    from tunelab.config.lora import LoRAArgs
    from tunelab.models import load_pretrained
    from tunelab.peft import apply_lora, get_adapter_params, load_peft_adapter

    model = load_pretrained(model_dir)
    lora = LoRAArgs(targets=["all-linear"], rank=4, alpha=8.0)
    linears = {name for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    swapped = apply_lora(model, lora, adapt_under=vision)
    in_tower = {name for name in swapped if name.startswith(model.vision_prefix)}
    assert in_tower == {name for name in linears if name.startswith(vision)}
    assert bool(in_tower) == bool(vision)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in get_adapter_params(model).items():
            if "lora_B" in name:
                param.normal_(std=0.2)
        for name, param in model.named_parameters():
            if name.startswith(full) and full:  # as build_model leaves a `full` part
                param.requires_grad_(True)
                param.add_(torch.randn_like(param) * 0.05)
    grids = [(1, 6, 8)]
    tokens = torch.tensor([spec.row(grids)])
    images = spec.images(grids)
    hf_inputs = spec.hf_inputs(tokens, images)
    with torch.no_grad():
        expected = model(tokens, **images)
    export = export_hf(model, folder / "epoch_0", base_checkpoint_dir=model_dir, lora=lora)

    adapter_dir = export / ADAPTER_DIR_NAME
    adapted = peft.PeftModel.from_pretrained(spec.load_hf(model_dir), adapter_dir).eval()
    theirs = peft.get_peft_model_state_dict(adapted, save_embedding_layers=False)
    # PEFT adapted exactly our modules (none of the tower's like-named linears), and every
    # weight it holds was in our file.
    assert set(theirs) == set(load_file(adapter_dir / "adapter_model.safetensors"))
    whole = [name for name, _ in model.named_parameters() if full and name.startswith(full)]
    assert len(theirs) == 2 * len(swapped) + len(whole)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert bool(config["modules_to_save"]) == bool(full)
    # PEFT wrapped each module the adapter names whole, and none besides.
    wrapped = [m for m in adapted.modules() if isinstance(m, peft.utils.ModulesToSaveWrapper)]
    assert len(wrapped) == len(config["modules_to_save"] or [])
    with torch.no_grad():
        assert float((adapted(**hf_inputs).logits - expected).abs().max()) <= TOLERANCE
        merged = spec.load_hf(export)(**hf_inputs).logits
        assert float((merged - expected).abs().max()) <= TOLERANCE
        base = spec.load_hf(model_dir)(**hf_inputs).logits
        assert float((base - expected).abs().max()) > 1e-2
    if full:
        return
    # And the adapter reads back into a fresh LoRA model here (as adapter_dir does).
    fresh = load_pretrained(model_dir)
    reread = LoRAArgs.from_peft_config(
        json.loads((adapter_dir / "adapter_config.json").read_text())
    )
    assert sorted(apply_lora(fresh, reread)) == sorted(swapped)
    load_peft_adapter(fresh, adapter_dir)
    with torch.no_grad():
        assert float((fresh(tokens, **images) - expected).abs().max()) == 0.0
