"""Generate a completion from a Hugging Face model folder: a user's first sanity check.

Launch: ``tunelab run generate --config tiny/generate prompt="..."``.
Loads a base model or an ``epoch_{E}`` export, optionally with a PEFT adapter on top, and
prints the completion (greedy, or temperature / top-k sampling, with a KV cache).
"""

import torch

import tunelab.peft as peft
from tunelab.config import GenerateArgs
from tunelab.data import Message, get_template, load_tokenizer, tokenize_messages
from tunelab.distributed import destroy_distributed, init_distributed, resolve_dtype
from tunelab.generation import generate
from tunelab.lifecycle import recipe_main
from tunelab.models import load_pretrained

ARGS = GenerateArgs


def main(args: GenerateArgs) -> None:
    """Print the model's completion of ``args.prompt``."""
    dist_info = init_distributed(args.device)
    tokenizer = load_tokenizer(args.model.path)
    model = load_pretrained(
        args.model.path, dtype=resolve_dtype(args.model.dtype), device=dist_info.device
    )
    if args.adapter_dir is not None:
        peft.apply_lora(
            model, peft.LoRAArgs.from_peft_config(peft.read_adapter_config(args.adapter_dir))
        )
        peft.load_peft_adapter(model, args.adapter_dir)
    model.eval()

    if args.template is None:
        text = args.prompt if args.input is None else f"{args.prompt}\n\n{args.input}"
        prompt = tokenizer.encode(text, add_bos=True)
    else:
        template = get_template(args.template, tokenizer)
        content = template.join_instruction(args.prompt, args.input or "")
        prompt, _ = tokenize_messages(
            tokenizer, [Message(role="user", content=content)], template, add_generation_prompt=True
        )
    generator = torch.Generator(device=dist_info.device).manual_seed(args.seed)
    completion = generate(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        stop_ids=set(tokenizer.stop_ids),
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
    )
    if dist_info.is_main:
        print(tokenizer.decode(completion), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
