r"""Regenerate the embedded tiny vision-language models in ``framework/tunelab/assets/``.

Run ``python -m tunelab.assets.build_tiny_vl`` (needs ``transformers``, a dev dependency) for
``tiny_vl/``, or ``python -m tunelab.assets.build_tiny_vl qwen3_vl`` for ``tiny_qwen3_vl/``.
``tiny_vl`` holds, written deterministically (fixed seeds):

- ``tokenizer.json``, ``tokenizer_config.json``: a byte-level BPE trained on the task text,
  with Qwen2.5-VL's special tokens and a Qwen2.5-VL style chat template (one
  ``<|vision_start|><|image_pad|><|vision_end|>`` per image); EOS ``<|im_end|>``;
- ``preprocessor_config.json``: Qwen2-VL preprocessing with images kept between 56 x 56 and
  112 x 112 pixels (4 to 16 image tokens);
- ``config.json``, ``model.safetensors``: a random tiny ``Qwen2_5_VLForConditionalGeneration``
  (2 language layers of width 64; a vision tower of 2 blocks, one windowed, one full);
- ``images/*.png``: coloured squares and circles on white, of two sizes;
- ``chat.jsonl``: questions about an image's colour or shape and their one-word answers, half
  with content parts, half with an ``images`` column and ``<image>`` placeholders;
- ``grpo_prompts.jsonl``: the same questions as GRPO prompts (``prompt``: the user turn, the
  ``images`` column where the chat row has one) with the answer in ``answer``.

``tiny_qwen3_vl`` holds the same tokenizer, Qwen3-VL's preprocessing (16-pixel patches, mean
and std 0.5, images kept between 64 x 64 and 128 x 128 pixels) and a random tiny
``Qwen3VLForConditionalGeneration`` (2 language layers of width 64; a vision tower of 2
blocks with a 4 x 4 position table, deepstack from block 0); its runs read ``tiny_vl``'s
images and ``chat.jsonl``.

``tiny_gemma3_vl`` (``python -m tunelab.assets.build_tiny_vl gemma3_vl``) holds a tokenizer
trained the same way with Gemma 3's special tokens and a Gemma-3-style chat template (turns
``<start_of_turn>user`` / ``<start_of_turn>model``, one ``<start_of_image>`` per image, which
the processor replaces with ``\n\n<start_of_image>``, 16 ``<image_soft_token>`` and
``<end_of_image>\n\n``), Gemma 3's preprocessing (64 x 64 pixels, mean and std 0.5, 16 soft
tokens per image) and a random tiny ``Gemma3ForConditionalGeneration`` (2 language layers of
width 64, one sliding-window and one global; a 2-block SigLIP tower of width 32 over 8-pixel
patches), written in the hub's key layout (``language_model.model.*``,
``vision_tower.vision_model.*``); its runs read ``tiny_vl``'s images and ``chat.jsonl``.
"""

import json
import random
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUTPUT_DIR = Path(__file__).resolve().parent / "tiny_vl"
QWEN3_VL_DIR = OUTPUT_DIR.with_name("tiny_qwen3_vl")
SEED = 1234
LM_HEAD_STD = 0.3
PROJECTOR_STD = 0.1
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}  # fmt: skip
SHAPES = ("square", "circle")
SIZES = ((56, 56), (112, 56))
QUESTIONS = {"colour": "What colour is the shape?", "shape": "Which shape is it?"}
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
QWEN3_VL_PREPROCESSOR = {
    **PREPROCESSOR,
    "min_pixels": 64 * 64,
    "max_pixels": 128 * 128,
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


GEMMA3_VL_DIR = OUTPUT_DIR.with_name("tiny_gemma3_vl")
GEMMA3_SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TOKENS_PER_IMAGE = 16
GEMMA3_PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor",
    "processor_class": "Gemma3Processor",
    "size": {"height": 64, "width": 64},
    "patch_size": 8,  # the tower's, for the grids tunelab reports (transformers ignores it)
    "resample": 2,
    "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": None,
    "image_seq_length": GEMMA3_TOKENS_PER_IMAGE,
}


def _image(colour: str, shape: str, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    width, height = size
    side = min(width, height) - 12
    left, top = (width - side) // 2, (height - side) // 2
    box = (left, top, left + side, top + side)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def _rows(rng: random.Random) -> list[dict]:
    rows = []
    for colour in COLOURS:
        for shape in SHAPES:
            for index, _ in enumerate(SIZES):
                name = f"images/{colour}_{shape}_{index}.png"
                for kind, question in QUESTIONS.items():
                    answer = (colour if kind == "colour" else shape).capitalize() + "."
                    if len(rows) % 2:
                        user = {"role": "user", "content": f"<image>{question}"}
                        row = {"messages": [user], "images": [name]}
                    else:
                        parts = [{"type": "image", "image": name}, {"type": "text", "text": question}]  # fmt: skip
                        row = {"messages": [{"role": "user", "content": parts}]}
                    row["messages"].append({"role": "assistant", "content": answer})
                    rows.append(row)
    rng.shuffle(rows)
    return rows


def _grpo_prompts(rows: list[dict]) -> list[dict]:
    """Each chat row as a GRPO prompt: its user turn, its images, its answer in ``answer``."""
    prompts = []
    for row in rows:
        user, assistant = row["messages"]
        prompt = {"prompt": [user], "answer": assistant["content"]}
        if "images" in row:
            prompt["images"] = row["images"]
        prompts.append(prompt)
    return prompts


def _tokenizer(out: Path, rows: list[dict], gemma3: bool = False) -> Tokenizer:
    template = GEMMA3_CHAT_TEMPLATE if gemma3 else CHAT_TEMPLATE
    corpus = [template, "You are a helpful assistant.", *QUESTIONS.values()]
    corpus += [row["messages"][-1]["content"] for row in rows]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=GEMMA3_SPECIALS if gemma3 else SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": template,
    }
    if gemma3:
        # The Gemma 3 processor reads the image tokens from the tokenizer's attributes.
        image_tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
        image_tokens["image_token"] = "<image_soft_token>"
        config.update(
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            extra_special_tokens=image_tokens,
        )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


def _text_config(tokenizer: Tokenizer) -> dict:
    """The tiny language model both families share (Qwen3-VL's adds ``head_dim``)."""
    return dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        pad_token_id=tokenizer.token_to_id("<|endoftext|>"),
    )


def _token_ids(tokenizer: Tokenizer) -> dict:
    return dict(
        image_token_id=tokenizer.token_to_id("<|image_pad|>"),
        video_token_id=tokenizer.token_to_id("<|video_pad|>"),
        vision_start_token_id=tokenizer.token_to_id("<|vision_start|>"),
        vision_end_token_id=tokenizer.token_to_id("<|vision_end|>"),
    )


def _model(out: Path, tokenizer: Tokenizer) -> None:
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            window_size=56,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        **_token_ids(tokenizer),
    )
    _save(transformers.Qwen2_5_VLForConditionalGeneration, config, out)


def _qwen3_vl_model(out: Path, tokenizer: Tokenizer) -> None:
    import transformers

    text = _text_config(tokenizer)
    text["head_dim"] = 16
    text["rope_parameters"]["mrope_interleaved"] = True
    config = transformers.Qwen3VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    _save(transformers.Qwen3VLForConditionalGeneration, config, out)


def _gemma3_vl_model(out: Path, tokenizer: Tokenizer) -> None:
    import transformers

    ids = {name: tokenizer.token_to_id(name) for name in GEMMA3_SPECIALS}
    text = _text_config(tokenizer)
    del text["rope_parameters"]  # Gemma 3's own defaults: 1e6 global, 1e4 sliding
    text.update(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=ids["<bos>"],
        eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
            vision_use_head=False,
        ),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        tie_word_embeddings=False,
    )
    _save(transformers.Gemma3ForConditionalGeneration, config, out)
    gemma3_hub_layout(out)
    (out / "processor_config.json").write_text(
        json.dumps(
            {"processor_class": "Gemma3Processor", "image_seq_length": GEMMA3_TOKENS_PER_IMAGE},
            indent=2,
        )
        + "\n"  # fmt: skip
    )


def gemma3_hub_layout(folder: Path) -> Path:
    """Rewrite a Gemma 3 ``model.safetensors`` saved by transformers 5 in the hub's key layout.

    transformers 5 writes the tower's keys without the hub's ``vision_model.``: put it back.
    """
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    hub = {
        key.replace("vision_tower.", "vision_tower.vision_model.", 1): value
        for key, value in load_file(weights).items()
    }
    save_file(hub, weights, metadata={"format": "pt"})
    return folder


def _save(model_class: type, config: object, out: Path) -> None:
    torch.manual_seed(SEED)
    model = model_class(config)
    with torch.no_grad():
        # transformers' std 0.02 output layer on width-64 hidden states (norm 8, the final
        # RMSNorm's) caps a logit near 1.3: no answer could become likely, however LoRA moved
        # the hidden states. A wider output layer lets a fine-tune express what it learns.
        model.lm_head.weight.normal_(std=LM_HEAD_STD)
        projector = getattr(model.model, "multi_modal_projector", None)
        if projector is not None:
            # Gemma 3's projection starts at zero in transformers: images would give nothing.
            projector.mm_input_projection_weight.normal_(std=PROJECTOR_STD)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)


def main() -> None:
    """Write the tiny VL assets into ``OUTPUT_DIR``, or the one the argument names.

    ``qwen3_vl``: ``QWEN3_VL_DIR``; ``gemma3_vl``: ``GEMMA3_VL_DIR``.
    """
    rng = random.Random(SEED)
    rows = _rows(rng)
    if sys.argv[1:] == ["gemma3_vl"]:
        out = GEMMA3_VL_DIR
        out.mkdir(exist_ok=True)
        tokenizer = _tokenizer(out, rows, gemma3=True)
        (out / "preprocessor_config.json").write_text(
            json.dumps(GEMMA3_PREPROCESSOR, indent=2) + "\n"
        )
        _gemma3_vl_model(out, tokenizer)
        print(f"wrote {out}")
        return
    if sys.argv[1:] == ["qwen3_vl"]:
        out = QWEN3_VL_DIR
        out.mkdir(exist_ok=True)
        tokenizer = _tokenizer(out, rows)
        (out / "preprocessor_config.json").write_text(
            json.dumps(QWEN3_VL_PREPROCESSOR, indent=2) + "\n"
        )
        _qwen3_vl_model(out, tokenizer)
        print(f"wrote {out}")
        return
    out = OUTPUT_DIR
    (out / "images").mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        for shape in SHAPES:
            for index, size in enumerate(SIZES):
                _image(colour, shape, size).save(out / f"images/{colour}_{shape}_{index}.png")
    (out / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = _grpo_prompts(rows)
    (out / "grpo_prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    tokenizer = _tokenizer(out, rows)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    _model(out, tokenizer)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
