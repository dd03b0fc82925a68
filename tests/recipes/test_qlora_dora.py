"""QLoRA and DoRA end to end: real ``tunelab run`` on 1 and 2 processes (gloo, fp32).

QLoRA runs on a tiny Llama whose every linear layer holds whole NF4 blocks on 2 processes
(hidden 256, the embedded tiny model's tokenizer): 2 and 1 processes, and HSDP with 2 replicas
of one shard, give the same losses, a
kill-and-resume continues exactly, and the merged export loads in transformers with the
logits of our NF4 model + adapter, as does PEFT with the adapter on the NF4-rounded base. A
QLoRA + DoRA DPO run starts at loss ln 2 (the reference, adapters off, is the policy at step
0), and its DoRA adapter loads in PEFT with our logits, which its merged export has too, and
llama.cpp the f16 GGUF export of that merged model (within 1e-2).
Under tensor parallelism 2 each rank's NF4 piece of every weight is one process's, bit for
bit (tp_nf4_script.py, on 2 processes and on FSDP 2 x tp 2), the losses are the FSDP run's and
the adapter loads in PEFT with our logits.
DoRA on a plain base against PEFT, both ways, is tests/interop/test_peft_dora.py.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import (
    interrupted_copy,
    losses_by_step,
    our_model,
    read_metrics,
    torchrun,
    tunelab_run,
)
from tunelab._paths import assets_dir

pytestmark = pytest.mark.slow
TINY = assets_dir() / "tiny"
SCRIPT = Path(__file__).with_name("tp_nf4_script.py")
# TP against FSDP: sums in another order; Adam carries them into the adapter (4.6e-6 seen).
EXPORT_TOLERANCE = 1e-5
STEPS = 4
COMMON = [
    "schedule.epochs=1",
    f"schedule.max_steps_per_epoch={STEPS}",
    "~val_dataset",
    "lr_scheduler.num_warmup_steps=0",
    "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
    "checkpoint.enable_async_checkpointing=false",
]
TOKENS = torch.randint(0, 800, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory):
    """A tiny random Llama (fp32) whose linear weights split into whole NF4 blocks on 2 ranks."""
    transformers = pytest.importorskip("transformers")
    tiny = json.loads((TINY / "config.json").read_text())
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=tiny["vocab_size"],
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"],
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("nf4_llama")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TINY / name, path / name)
    return path


def _run(config, out, *extra, nproc=2):
    batch = "schedule.batch_size=4" if nproc == 2 else "schedule.batch_size=8"
    return tunelab_run(
        "lora_finetune_distributed", config, f"output_dir={out}", batch, *COMMON, *extra,
        nproc=nproc,
    )  # fmt: skip


@pytest.fixture(scope="module")
def qlora_2p(tmp_path_factory, nf4_model_dir):
    out = tmp_path_factory.mktemp("qlora_2p")
    result = _run("tiny/qlora", out, f"model.path={nf4_model_dir}")
    # Every linear weight but lm_head is quantized: no "kept in the training dtype" notice.
    assert "kept in the training dtype" not in result.stdout + result.stderr
    return out


def test_qlora_1_and_2_processes_resume_and_export(qlora_2p, nf4_model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchao.quantization import to_nf4

    from tunelab.peft.nf4 import is_nf4

    losses = losses_by_step(qlora_2p)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    one = tmp_path / "one"
    _run("tiny/qlora", one, f"model.path={nf4_model_dir}", nproc=1)
    for step, loss in losses_by_step(one).items():
        assert abs(loss - losses[step]) <= 1e-5, (step, loss, losses[step])

    # Killed after step 2: the resumed run re-quantizes the base and continues exactly.
    resumed = interrupted_copy(qlora_2p, tmp_path / "resumed", after_step=2)
    _run("tiny/qlora", resumed, f"model.path={nf4_model_dir}",
         "checkpoint.resume_from_checkpoint=true")  # fmt: skip
    assert losses_by_step(resumed) == {step: losses[step] for step in (3, 4)}

    # The merged export: transformers' logits equal our NF4 base + adapter's.
    export = qlora_2p / "epoch_0"
    ours = our_model(nf4_model_dir, export / "adapter", quantize_base="nf4")
    assert is_nf4(ours.layers[0].self_attn.q_proj.weight)
    assert is_nf4(ours.layers[1].mlp.down_proj.weight)
    with torch.no_grad():
        expected = ours(TOKENS)
        merged, info = transformers.AutoModelForCausalLM.from_pretrained(
            export, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert (merged(TOKENS).logits - expected).abs().max() < 1e-4
        # PEFT users: the adapter on the NF4-rounded base gives our logits too.
        peft_model = _peft_on_dequantized_base(nf4_model_dir, export / "adapter")
        assert (peft_model(TOKENS).logits - expected).abs().max() < 1e-4
        # Not the original base + adapter: the NF4 rounding is in the merged weights.
        original = transformers.AutoModelForCausalLM.from_pretrained(nf4_model_dir)
        name = "model.layers.0.mlp.down_proj.weight"
        dequantized = to_nf4(original.state_dict()[name]).get_original_weight()
        assert not torch.equal(merged.state_dict()[name], original.state_dict()[name])
        assert (merged.state_dict()[name] - dequantized).abs().max() < 0.05


# HSDP meshes where a rank's shard coordinate differs from its global rank, global batch 8 as
# the FSDP run's. (2, 1): each rank holds whole NF4 weights (FSDP2 copies, does not gather);
# 2 x 2 on 4 processes: each shard group quantizes its halves of the rows. Either way the NF4
# bytes equal the FSDP run's bit for bit, so losses and export agree to fp32 reduction order.
@pytest.mark.parametrize(
    ("replicate", "shard", "nproc"), [(2, 1, 2), (2, 2, 4)], ids=["hsdp2x1", "hsdp2x2"]
)
def test_qlora_hsdp_matches_fsdp(qlora_2p, nf4_model_dir, tmp_path, replicate, shard, nproc):
    out = tmp_path / "hsdp"
    _run("tiny/qlora", out, f"model.path={nf4_model_dir}",
         f"parallelism.data_parallel_replicate_size={replicate}", f"parallelism.data_parallel_shard_size={shard}",
         f"schedule.batch_size={8 // nproc}", nproc=nproc)  # fmt: skip
    losses, reference = losses_by_step(out), losses_by_step(qlora_2p)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    for step in losses:
        assert abs(losses[step] - reference[step]) <= 1e-6, (step, losses, reference)
    ours = load_file(out / "epoch_0" / "model.safetensors")
    fsdp = load_file(qlora_2p / "epoch_0" / "model.safetensors")
    assert ours.keys() == fsdp.keys()
    for key in ours:
        assert torch.allclose(ours[key], fsdp[key], rtol=0, atol=1e-6), key


@pytest.fixture(scope="module")
def qlora_tp2(tmp_path_factory, nf4_model_dir):
    """QLoRA with tensor parallelism 2 on 2 processes, the FSDP run's global batch of 8."""
    out = tmp_path_factory.mktemp("qlora_tp2")
    result = _run("tiny/qlora", out, f"model.path={nf4_model_dir}",
                  "parallelism.tensor_parallel_size=2", "schedule.batch_size=8")  # fmt: skip
    # Each rank's half of every linear weight holds whole NF4 blocks: all of them quantized.
    assert "kept in the training dtype" not in result.stdout + result.stderr
    return out


def test_qlora_tensor_parallel_matches_fsdp_and_exports_for_peft(
    qlora_tp2, qlora_2p, nf4_model_dir
):
    """Each rank quantizes its rows or columns to one process's NF4 bytes (tp_nf4_script.py
    checks the pieces): the losses are the FSDP run's (itself one process's) to fp32
    reduction order, and the adapter and merged export load in PEFT and transformers."""
    transformers = pytest.importorskip("transformers")
    losses, reference = losses_by_step(qlora_tp2), losses_by_step(qlora_2p)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    for step in losses:
        assert abs(losses[step] - reference[step]) <= 1e-5, (step, losses, reference)
    norms, expected = _grad_norms(qlora_tp2), _grad_norms(qlora_2p)
    for step in losses:
        assert abs(norms[step] - expected[step]) <= 1e-5 * expected[step], (step, norms, expected)
    export = qlora_tp2 / "epoch_0"
    ours = our_model(nf4_model_dir, export / "adapter", quantize_base="nf4")
    with torch.no_grad():
        expected = ours(TOKENS)
        merged = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        assert (merged(TOKENS).logits - expected).abs().max() < 1e-4
        peft_model = _peft_on_dequantized_base(nf4_model_dir, export / "adapter")
        assert (peft_model(TOKENS).logits - expected).abs().max() < 1e-4
    fsdp = load_file(qlora_2p / "epoch_0" / "model.safetensors")
    tp = load_file(export / "model.safetensors")
    assert tp.keys() == fsdp.keys()
    for key in tp:
        assert torch.allclose(tp[key], fsdp[key], rtol=0, atol=EXPORT_TOLERANCE), key


def _grad_norms(output_dir):
    return {row["step"]: row["grad_norm"] for row in read_metrics(output_dir) if "grad_norm" in row}


def test_qlora_fsdp2_x_tp2_pieces_are_one_process_nf4(nf4_model_dir):
    # FSDP2 shards each tp piece over 2 more processes (a column-wise piece's rows as
    # _StridedShard). 2 layers x 5 linear weights: k_proj's and v_proj's quarters (32 x 256
    # values) hold no whole group of NF4 scales and stay in fp32, as without tp.
    result = torchrun(SCRIPT, str(nf4_model_dir), nproc=4)
    assert result.stdout.count("checked 10\n") == 4, result.stdout


def _peft_on_dequantized_base(base_dir, adapter_dir):
    """PEFT's model: the adapter on the base whose linear weights (not lm_head) went through NF4."""
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    from torchao.quantization import to_nf4

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(to_nf4(module.weight.detach()).get_original_weight())
    return peft_lib.PeftModel.from_pretrained(base, adapter_dir).eval()


def test_qlora_dora_dpo_adapter_loads_in_peft_with_our_logits_and_the_merged_export(
    nf4_model_dir, tmp_path
):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "dpo"
    tunelab_run(
        "lora_dpo_distributed", "qwen2_5/1.5B_qlora_dpo", f"output_dir={out}",
        f"model.path={nf4_model_dir}", "model.dtype=fp32", "lora.use_dora=true",
        "tokenizer.max_seq_len=128", "dataset.source=json", "~dataset.split",
        "~dataset.column_map", f"dataset.data_files={TINY}/preference.jsonl",
        "dataset.template=instruct", "dataset.max_seq_len=128", "schedule.batch_size=2",
        "schedule.gradient_accumulation_steps=1", "schedule.max_steps_per_epoch=3", "optimizer.lr=1e-2",
        "model.activation_checkpointing=false", "lr_scheduler.num_warmup_steps=0",
        "checkpoint.save_every_n_steps=null", "checkpoint.enable_async_checkpointing=false",
    )  # fmt: skip
    losses = losses_by_step(out)
    # At step 1 the policy (B = 0, magnitude = ||W||) equals the reference, adapters off.
    assert abs(losses[1] - math.log(2)) < 1e-6, losses
    adapter = out / "epoch_0" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["use_dora"] is True
    ours = our_model(nf4_model_dir, adapter, quantize_base="nf4")
    peft_model = _peft_on_dequantized_base(nf4_model_dir, adapter)
    with torch.no_grad():
        expected = ours(TOKENS)
        with peft_model.disable_adapter():
            assert (peft_model(TOKENS).logits - expected).abs().max() > 1e-3  # it trained
        # Every adapter weight PEFT expects is in the file (PEFT only warns on missing keys).
        names = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
        assert sum("lora_magnitude_vector" in n for n in names) * 3 == len(names)
        layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
        magnitude = ours.layers[0].self_attn.q_proj.lora_magnitude_vector
        assert torch.equal(layer.lora_magnitude_vector["default"].weight, magnitude)
        assert (peft_model(TOKENS).logits - expected).abs().max() < 1e-4
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "epoch_0")
        assert (merged(TOKENS).logits - expected).abs().max() < 1e-4
    # The GGUF export is made from that merged model: llama.cpp computes our logits too.
    pytest.importorskip("llama_cpp")
    from tests.gguf_checks import llama, llama_logits
    from tunelab.checkpoint.gguf_export import export_gguf

    gguf_model = llama(export_gguf(out / "epoch_0", quant="f16"))
    for row, logits in zip(TOKENS.tolist(), expected, strict=True):
        assert abs(llama_logits(gguf_model, row) - logits.double().numpy()).max() < 1e-2
