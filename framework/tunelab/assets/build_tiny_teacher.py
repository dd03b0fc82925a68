"""Build the tiny distillation teacher: the embedded tiny Llama made 2x wider, SFT-trained briefly.

Run ``python -m tunelab.assets.build_tiny_teacher --output-dir outputs/tiny_teacher`` before
``tunelab run distill_distributed --config tiny/distill`` (needs ``transformers``). It writes a
Hugging Face folder with the tiny model's tokenizer (so the vocabulary is the student's) and a
Llama of twice the tiny model's hidden, feed-forward and head counts, trained from a fixed seed
for ``--steps`` AdamW steps on the embedded SFT data (``sft.jsonl``, prompt tokens masked), on
one CPU thread: the same folder every time, in about a minute.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch

from tunelab._paths import assets_dir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
SEED = 4321


def teacher_config(tiny_config: dict) -> dict:
    """The tiny model's ``config.json`` made twice as wide (same depth, head size, vocabulary)."""
    config = dict(tiny_config)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        config[key] = 2 * tiny_config[key]
    return config


def build_teacher(output_dir: Path, *, steps: int = 60, batch_size: int = 16) -> Path:
    """Write the teacher folder and return it.

    Args:
        output_dir: Where the Hugging Face folder goes (created).
        steps: AdamW steps on the embedded SFT data.
        batch_size: Rows per step.

    Returns:
        ``output_dir``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from tunelab.data import instruct_dataset, load_tokenizer, padded_collate_sft

    tiny = assets_dir() / "tiny"
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    config = teacher_config(json.loads((tiny / "config.json").read_text()))
    model = LlamaForCausalLM(LlamaConfig(**config)).float()
    tokenizer = load_tokenizer(tiny, max_seq_len=128)
    data = instruct_dataset(
        tokenizer,
        source="json",
        data_files=str(tiny / "sft.jsonl"),
        template="instruct",
        train_on_input=False,
        max_seq_len=128,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED)).tolist()
    model.train()
    for step in range(steps):
        start = (step * batch_size) % max(len(order) - batch_size, 1)
        rows = [data[i] for i in order[start : start + batch_size]]
        batch = padded_collate_sft(rows, pad_id=tokenizer.pad_id)
        logits = model(input_ids=batch["tokens"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir)
    for name in TOKENIZER_FILES:
        if (tiny / name).is_file():
            shutil.copy(tiny / name, output_dir / name)
    print(f"tiny teacher ({steps} steps, last loss {loss.item():.3f}) in {output_dir}", flush=True)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--output-dir`` (required), ``--steps``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    build_teacher(args.output_dir, steps=args.steps)


if __name__ == "__main__":
    main()
