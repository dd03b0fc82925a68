"""Regenerate the embedded tiny default in ``framework/tunelab/assets/tiny/``.

Run ``python -m tunelab.assets.build_tiny`` (needs ``transformers``, a dev dependency). It
writes, deterministically (fixed seeds, one CPU thread):

- ``tokenizer.json``: a byte-level BPE trained with ``tokenizers`` on the generated text, with
  the Llama 3 and ChatML special tokens; ``tokenizer_config.json`` and
  ``special_tokens_map.json`` (bos ``<|begin_of_text|>``, eos ``<|end_of_text|>``, pad
  ``<|pad|>``);
- ``config.json``, ``generation_config.json``, ``model.safetensors``: a tiny Llama built with
  ``transformers.LlamaConfig`` / ``LlamaForCausalLM`` and briefly pretrained on generic text
  from the task generator, so it is a meaningful base;
- ``sft.jsonl``, ``sft_val.jsonl`` (alpaca instruction/input/output), ``chat.jsonl``
  (``messages``), ``preference.jsonl`` and ``preference_val.jsonl`` (prompt/chosen/rejected);
- ``tool_calls.jsonl`` (``tools`` and ``messages`` with tool calls, results and reasoning) and
  ``tools_chat_template.jinja``, a ChatML tool template that renders them (``_tools``);
- ``calculator_calls.jsonl`` and ``calculator_prompts.jsonl``: additions, half answered
  through the calculator tool, and prompts of other additions with their answers (``_tools``).
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tunelab.assets import _tasks, _tools

OUTPUT_DIR = Path(__file__).resolve().parent / "tiny"
SEED = 1234
VOCAB_SIZE = 1024
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [
    BOS,
    EOS,
    PAD,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]
# Llama 3's pre-tokenizer split: digits in groups of up to three, newlines kept apart from words.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The same rendering as tunelab's ``llama3`` template, for transformers' apply_chat_template.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
PRETRAIN = dict(num_documents=24000, seq_len=128, batch_size=16, steps=400, lr=3e-3, warmup=40)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def build_tokenizer(corpus: list[str]) -> Tokenizer:
    """Train the byte-level BPE on ``corpus``; special tokens take ids 0-7."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": MODEL_CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
            "chat_template": LLAMA3_CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    )


def write_datasets(out: Path, rng: random.Random) -> None:
    """Write the SFT, validation, chat, preference and GRPO prompt JSONL files."""
    train = _tasks.make_examples(rng, 1600)
    val = _tasks.make_examples(rng, 100, exclude={_tasks.example_key(e) for e in train})
    alpaca = [{"instruction": e.instruction, "input": e.input, "output": e.output} for e in train]
    _write_jsonl(out / "sft.jsonl", alpaca)
    _write_jsonl(
        out / "sft_val.jsonl",
        [{"instruction": e.instruction, "input": e.input, "output": e.output} for e in val],
    )
    chats = []
    for _ in range(300):
        turns = _tasks.make_examples(rng, rng.randint(1, 2), distinct=False)
        messages = (
            [{"role": "system", "content": _tasks.SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        )
        for example in turns:
            messages.append({"role": "user", "content": example.prompt})
            messages.append({"role": "assistant", "content": example.output})
        chats.append({"messages": messages})
    _write_jsonl(out / "chat.jsonl", chats)
    pairs = _tasks.make_examples(rng, 400, distinct=False)
    _write_jsonl(
        out / "preference.jsonl",
        [{"prompt": e.prompt, "chosen": e.output, "rejected": e.wrong} for e in pairs],
    )
    _write_jsonl(out / "kto.jsonl", kto_rows(pairs))
    _write_jsonl(out / "preference_val.jsonl", held_out_pairs({e.prompt for e in pairs}))
    # GRPO's prompts with their answers (tiny/grpo), from a random source of their own: the
    # files above and the model stay as they were.
    prompts = _tasks.make_examples(random.Random(26), 256)
    _write_jsonl(
        out / "grpo_prompts.jsonl", [{"prompt": e.prompt, "answer": e.output} for e in prompts]
    )
    # Tool-calling conversations (tiny/chat_tools_lora), from a random source of their own too.
    _write_jsonl(out / "tool_calls.jsonl", _tools.tool_rows(random.Random(29), 300))
    (out / "tools_chat_template.jinja").write_text(_tools.TOOLS_CHAT_TEMPLATE)
    # Additions through the calculator (tiny/agentic_sft, tiny/agentic_grpo), likewise.
    calls, prompts = _tools.calculator_rows(random.Random(41), 512)
    _write_jsonl(out / "calculator_calls.jsonl", calls)
    _write_jsonl(out / "calculator_prompts.jsonl", prompts)


def held_out_pairs(train_prompts: set[str], count: int = 96) -> list[dict[str, str]]:
    """Validation pairs of new prompts, of the tasks whose rule carries over (tiny/reward_model).

    Reversals, sorts and counts, none of whose prompts is a training pair's: a reward model
    that learned a task's rule from the training pairs ranks them. No next-number pairs: every
    number is one token of the tiny vocabulary, so a new next-number prompt asks for the
    successor of a token no training pair shows, a fact neither the pairs nor the base model
    hold (the base model's own log-probs rank such pairs at 0.47, a trained reward model at
    about 0.4-0.5). From a random source of their own, so the other files and the model stay
    as they were.
    """
    tasks = tuple(task for task in _tasks.TASKS if task is not _tasks.next_number)
    candidates = _tasks.make_examples(random.Random(31), 2 * count, tasks=tasks)
    kept = [e for e in candidates if e.prompt not in train_prompts][:count]
    return [{"prompt": e.prompt, "chosen": e.output, "rejected": e.wrong} for e in kept]


def kto_rows(pairs: list[_tasks.Example]) -> list[dict[str, object]]:
    """KTO's labelled completions (tiny/kto), one per preference pair: unpaired, as logs are.

    Even rows keep the pair's chosen answer (label true), odd rows its rejected one (false).
    """
    return [
        {"prompt": e.prompt, "completion": e.wrong if i % 2 else e.output, "label": not i % 2}
        for i, e in enumerate(pairs)
    ]


def _pretraining_batches(tokenizer: Tokenizer, rng: random.Random) -> torch.Tensor:
    """Tokenize generic documents as BOS + text + EOS, concatenated and cut into rows."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for doc in _tasks.pretraining_text(rng, PRETRAIN["num_documents"]):
        ids.extend(tokenizer.encode(doc).ids + [eos_id])  # the post-processor adds BOS
    seq_len = PRETRAIN["seq_len"]
    num_rows = len(ids) // seq_len
    return torch.tensor(ids[: num_rows * seq_len]).view(num_rows, seq_len)


def build_model(tokenizer: Tokenizer, rng: random.Random, out: Path) -> None:
    """Build the tiny Llama, pretrain it briefly and save it in Hugging Face format."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id, eos_id, pad_id = (tokenizer.token_to_id(t) for t in (BOS, EOS, PAD))
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **MODEL_CONFIG,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    rows = _pretraining_batches(tokenizer, rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=0.01)
    steps, warmup = PRETRAIN["steps"], PRETRAIN["warmup"]
    generator = torch.Generator().manual_seed(SEED)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        # Linear warm-up, then cosine decay to 10% of the peak learning rate.
        progress = max(0.0, (step - warmup) / (steps - warmup))
        scale = (
            (step + 1) / warmup
            if step < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        )
        for group in optimizer.param_groups:
            group["lr"] = PRETRAIN["lr"] * scale
        batch = rows[torch.randint(len(rows), (PRETRAIN["batch_size"],), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(
                f"pretrain step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - start:.0f}s)"
            )
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=[
            eos_id,
            tokenizer.token_to_id("<|eot_id|>"),
            tokenizer.token_to_id("<|im_end|>"),
        ],
        pad_token_id=pad_id,
        do_sample=False,
    ).save_pretrained(out)


def build_text_assets(out: Path) -> Tokenizer:
    """Write the tokenizer files and the datasets (the fast, model-free part).

    Args:
        out: The output folder.

    Returns:
        The trained tokenizer.
    """
    corpus_rng = random.Random(SEED)
    corpus = _tasks.pretraining_text(corpus_rng, 4000)
    corpus += [
        e.prompt + " " + e.output for e in _tasks.make_examples(corpus_rng, 4000, distinct=False)
    ]
    # The templates' fixed text, so that it gets merges of its own.
    corpus += [
        f"### Instruction:\n{e.instruction}\n\n### Input:\n{e.input}\n\n### Response:\n{e.output}"
        for e in _tasks.make_examples(corpus_rng, 500, distinct=False)
    ]
    corpus += ["system\n", "user\n", "assistant\n"] * 100
    tokenizer = build_tokenizer(corpus)
    write_tokenizer_files(tokenizer, out)
    write_datasets(out, random.Random(SEED + 1))
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    """Regenerate every file of the tiny default.

    Args:
        argv: Command-line arguments (``--output-dir``); ``None`` reads ``sys.argv``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # bitwise-reproducible reductions
    tokenizer = build_text_assets(out)
    build_model(tokenizer, random.Random(SEED + 2), out)
    (out / "model.safetensors").chmod(0o644)  # the writer leaves it private to the owner
    print(f"wrote {sorted(p.name for p in out.iterdir())} to {out}")


if __name__ == "__main__":
    main()
