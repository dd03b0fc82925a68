"""Regenerate the embedded tiny mixture-of-experts model in ``framework/tunelab/assets/tiny_moe/``.

Run ``python -m tunelab.assets.build_tiny_moe`` (needs ``transformers``, a dev dependency) after
``tunelab.assets.build_tiny``. The model is the tiny Llama of ``assets/tiny`` upcycled into a
Mixtral (sparse upcycling, Komatsuzaki et al., 2022, https://arxiv.org/abs/2212.05055): the
same embeddings, attention and norms, and in each layer 4 experts that start as copies of the
dense MLP (plus noise of 1e-3 of its scale, so they can drift apart) under a random top-2
router. With the top-2 weights renormalised, it computes about what the tiny Llama computes,
so LoRA fine-tuning starts from a meaningful base. Saved in the hub's per-expert layout
(``block_sparse_moe.experts.N.w1/w2/w3``), beside copies of the tiny tokenizer files.

Stored in float32, the dtype its configs train in (``configs/tiny/moe_lora.yaml``:
``dtype: fp32``), so ``config.json`` says ``float32`` and transformers loads it so by default:
the PEFT snippet of the docs then gives the merged export's logits (a bfloat16 base was 0.1
away). The values are rounded to bfloat16 first, as the asset always held them (every value
exactly a bfloat16), so loading it in bfloat16 loses nothing and every run on it computes what
it computed before.
"""

import argparse
import shutil
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent
SOURCE_DIR = ASSETS / "tiny"
OUTPUT_DIR = ASSETS / "tiny_moe"
NUM_EXPERTS = 4
SEED = 4321
_COPIED = (
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def build(out: Path) -> None:
    """Upcycle the tiny Llama into a tiny Mixtral and save it with the tokenizer files."""
    from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    dense = LlamaForCausalLM.from_pretrained(SOURCE_DIR, dtype=torch.float32)
    source = dense.config
    config = MixtralConfig(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=source.head_dim,
        max_position_embeddings=source.max_position_embeddings,
        rms_norm_eps=source.rms_norm_eps,
        rope_parameters=dict(source.rope_parameters),
        tie_word_embeddings=source.tie_word_embeddings,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        sliding_window=None,
    )
    torch.manual_seed(SEED)
    model = MixtralForCausalLM(config).float()
    state = dense.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in state:
                param.copy_(state[name])
        for index, layer in enumerate(model.model.layers):
            mlp = f"model.layers.{index}.mlp."
            gate_up = torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
            down = state[mlp + "down_proj.weight"]
            for stacked, weight in ((layer.mlp.experts.gate_up_proj, gate_up),
                                    (layer.mlp.experts.down_proj, down)):  # fmt: skip
                noise = torch.randn(stacked.shape) * (1e-3 * weight.std())
                stacked.copy_(weight.expand_as(stacked) + noise)
            layer.mlp.gate.weight.normal_(0.0, 0.02)
    model.to(torch.bfloat16).to(torch.float32).eval().save_pretrained(out)
    for name in _COPIED:
        shutil.copyfile(SOURCE_DIR / name, out / name)
    (out / "model.safetensors").chmod(0o644)


def main(argv: list[str] | None = None) -> None:
    """Regenerate the tiny MoE model.

    Args:
        argv: Command-line arguments (``--output-dir``); ``None`` reads ``sys.argv``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    build(args.output_dir)
    print(f"wrote {sorted(p.name for p in args.output_dir.iterdir())} to {args.output_dir}")


if __name__ == "__main__":
    main()
