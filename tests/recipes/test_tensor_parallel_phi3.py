"""Tensor parallelism on Phi-3's fused projections (issue 45) on gloo.

``qkv_proj`` and ``gate_up_proj`` are split as any column-wise weight and their outputs
regrouped per part (``tunelab.distributed._fused_parallel``). On the tiny Phi-3 of
tests/conftest.py (GQA: 4 query and 2 key/value heads, so q, k and v are not as wide; partial
rotary, LongRoPE, a sliding window) TP=2 on 2 processes trains as 1 process with the same
global batch for 3 steps, as the other families do in test_tensor_parallel.py: LoRA on every
linear layer, the fused ones included, and full fine-tuning. Losses and gradient norms agree
within 1e-5, and so do the exports (merged model, PEFT adapter). The TP run's export loads in
transformers and PEFT. Its step-2 checkpoint resumes under plain FSDP=2 and finishes as the
TP run did. FSDP=2 x TP=2 on 4 processes equals 1 process too (slow). One set of weights
exported under FSDP and under TP=2 gives the same bytes.
QLoRA (NF4 base, each rank quantizing its own rows of the fused weights) too, on a wider\nPhi-3 (slow). The unit part checks the regrouping plan by hand.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import build_tiny_hf_model
from tests.recipes.conftest import assert_same_exports, interrupted_copy, torchrun, tunelab_run
from tests.recipes.test_tensor_parallel import (
    SCRIPT,
    TIGHT_EXPORT_TOLERANCE,
    TP2,
    _assert_same_training,
    _model,
)
from tunelab._paths import assets_dir
from tunelab.distributed._fused_parallel import _regroup_plan
from tunelab.distributed.tensor_parallel import check_tensor_parallel

STEPS = 3
TARGETS = "[qkv_proj,o_proj,gate_up_proj,down_proj]"
# As test_tensor_parallel.py's other families: packed rows (document masks), plain SGD, so
# the exports compare at 1e-5 (Adam turns rounding of near-zero gradients into updates).
SETTINGS = [
    "dataset.packed=true", "dataset.max_seq_len=120", "tokenizer.max_seq_len=120",
    "schedule.batch_size=2", "schedule.epochs=1", f"schedule.max_steps_per_epoch={STEPS}",
    "~val_dataset", "lr_scheduler.num_warmup_steps=0", "optimizer._component_=torch.optim.SGD",
    "optimizer.lr=0.1", "checkpoint.save_every_n_steps=2",
    "checkpoint.keep_last_n_checkpoints=null",
]  # fmt: skip


@pytest.fixture(scope="module")
def phi3_base(tmp_path_factory):
    """The tiny Phi-3, sized for the tiny tokenizer, with that tokenizer's files."""
    base = tmp_path_factory.mktemp("phi3") / "base"
    build_tiny_hf_model("phi3", vocab_size=810, bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(base)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(assets_dir() / "tiny" / name, base / name)
    return base


def _run(out, recipe, config, base, *overrides, nproc):
    tunelab_run(recipe, config, f"output_dir={out}", f"model.path={base}", *SETTINGS, *overrides,
                nproc=nproc)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, phi3_base):
    """LoRA on every linear layer, 1 process and TP=2 on 2 (global batch 2 both), read-only."""
    root = tmp_path_factory.mktemp("phi3_tp_lora")
    recipe = ("lora_finetune_distributed", "tiny/lora", phi3_base, f"lora.targets={TARGETS}")
    return _run(root / "one", *recipe, nproc=1), _run(root / "tp2", *recipe, TP2, nproc=2)


@pytest.mark.slow
def test_lora_tp2_equals_one_process(lora_runs):
    one, tp2 = lora_runs
    _assert_same_training(tp2, one, steps=range(1, STEPS + 1))
    assert_same_exports(tp2, one, atol=TIGHT_EXPORT_TOLERANCE)
    adapter = load_file(tp2 / "epoch_0" / "adapter" / "adapter_model.safetensors")
    fused = [key for key in adapter if ".qkv_proj.lora_B" in key or ".gate_up_proj.lora_B" in key]
    assert len(fused) == 4 and all(float(adapter[key].abs().max()) > 0 for key in fused)


@pytest.mark.slow
def test_tp2_exports_load_in_transformers_and_peft(lora_runs, phi3_base):
    # The merged export loads with every key; the adapter, applied by PEFT to the base, gives
    # its logits (the fused lora_B rows in PEFT's order), and changes the model.
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def hf(path, **kwargs):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", **kwargs
        )

    export = lora_runs[1] / "epoch_0"
    merged, info = hf(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    adapted = peft.PeftModel.from_pretrained(hf(phi3_base), export / "adapter").eval()
    tokens = torch.randint(0, 810, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged.eval()(tokens).logits
        assert float((adapted(tokens).logits - expected).abs().max()) <= 1e-4
        assert float((hf(phi3_base).eval()(tokens).logits - expected).abs().max()) > 1e-4


@pytest.mark.slow
def test_lora_tp2_checkpoint_resumes_under_fsdp2(lora_runs, phi3_base, tmp_path):
    # The TP run's step-2 checkpoint (the fused lora_B split over the fused rows, as the
    # plain run's) loads into FSDP2 on 2 processes of batch 1 (the same global batch).
    _, tp2 = lora_runs
    out = interrupted_copy(tp2, tmp_path / "fsdp2", after_step=2)
    _run(out, "lora_finetune_distributed", "tiny/lora", phi3_base, f"lora.targets={TARGETS}",
         "schedule.batch_size=1", "checkpoint.resume_from_checkpoint=true", nproc=2)  # fmt: skip
    _assert_same_training(out, tp2, steps=range(STEPS, STEPS + 1))
    assert_same_exports(out, tp2, atol=TIGHT_EXPORT_TOLERANCE)


@pytest.mark.slow
def test_fsdp2_x_tp2_on_four_processes_equals_one_process(lora_runs, phi3_base, tmp_path):
    # FSDP2 shards each rank's block of the fused rows further; the outputs are regrouped
    # over the tp pairs (0, 1) and (2, 3) only.
    one, _ = lora_runs
    out = _run(tmp_path / "fsdp2_tp2", "lora_finetune_distributed", "tiny/lora", phi3_base,
               f"lora.targets={TARGETS}", "schedule.batch_size=1", TP2,
               "model.frozen_base=shard", nproc=4)  # fmt: skip
    _assert_same_training(out, one, steps=range(1, STEPS + 1))
    assert_same_exports(out, one, atol=TIGHT_EXPORT_TOLERANCE)


@pytest.mark.slow
def test_full_finetune_tp2_equals_one_process(tmp_path, phi3_base):
    recipe = ("full_finetune_distributed", "tiny/full", phi3_base)
    one = _run(tmp_path / "one", *recipe, nproc=1)
    tp2 = _run(tmp_path / "tp2", *recipe, TP2, nproc=2)
    _assert_same_training(tp2, one, steps=range(1, STEPS + 1))
    assert_same_exports(tp2, one, atol=TIGHT_EXPORT_TOLERANCE)


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp2_export_of_fused_projections_is_byte_identical_to_the_fsdp_export(tmp_path, phi3_base, nproc):  # fmt: skip
    # The same weights (adapters set to the same non-zero values) under plain FSDP and TP=2
    # give the same files, byte for byte: each rank writes its contiguous rows of the fused
    # weights, as FSDP's ranks do. On 4 processes FSDP=4 against FSDP=2 x TP=2.
    targets = "qkv_proj,o_proj,gate_up_proj,down_proj"
    result = torchrun(SCRIPT, str(tmp_path), str(phi3_base), targets, nproc=nproc)
    fsdp, tp = tmp_path / "fsdp", tmp_path / "tp"
    files = sorted(p.relative_to(fsdp) for p in fsdp.rglob("*.safetensors"))
    assert [str(f) for f in files] == ["adapter/adapter_model.safetensors", "model.safetensors"]
    for name in files:
        assert (tp / name).read_bytes() == (fsdp / name).read_bytes(), name
    adapter = load_file(tp / "adapter" / "adapter_model.safetensors")
    assert any(".qkv_proj.lora_B" in key for key in adapter)
    (line,) = [row for row in result.stdout.splitlines() if row.startswith('{"gathered"')]
    gathered = json.loads(line)["gathered"]
    assert gathered["names"] and all(".lora_" in name for name in gathered["names"]), gathered


# -- unit: the regrouping plan, refusals (no process group) ------------------------------


def test_regroup_plan_sends_each_rank_its_slice_of_every_part():
    # Fused rows q 0-3, k 4-5, v 6-7 on 2 ranks: rank 0 stores rows 0-3 and computes q 0-1,
    # k 4, v 6; rank 1 stores rows 4-7 and computes q 2-3, k 5, v 7.
    zero, one = _regroup_plan([4, 2, 2], 2, 0), _regroup_plan([4, 2, 2], 2, 1)
    # Rank 0 keeps rows 0, 1 and sends 2, 3; it receives 4 and 6 (local rows 0 and 2 of
    # rank 1), rank 1 keeping 5 and 7 (its local 1 and 3).
    assert zero["index"].tolist() == [0, 1, 2, 3]
    assert zero["send_splits"] == zero["receive_splits"] == [2, 2]
    assert one["index"].tolist() == [0, 2, 1, 3]
    assert one["send_splits"] == one["receive_splits"] == [2, 2]
    # gate 0-3, up 4-7: rank 0 computes gate 0-1 and up 4-5.
    zero = _regroup_plan([4, 4], 2, 0)
    assert zero["index"].tolist() == [0, 1, 2, 3] and zero["receive_splits"] == [2, 2]
    # One rank: everything stays.
    alone = _regroup_plan([4, 2, 2], 1, 0)
    assert alone["index"].tolist() == list(range(8)) and alone["send_splits"] == [8]


def test_fused_projections_are_accepted_where_sizes_divide():
    # Sizes that do not divide: test_tensor_parallel.py's refusals, fused rows among them.
    check_tensor_parallel(_model(fused_projections=True), 2)


@pytest.mark.slow
def test_dora_with_lora_dropout_tp2_equals_one_process(tmp_path, phi3_base):
    # DoRA's magnitude split like the fused rows (each rank's rows whole, so their norms are
    # local); the dropout mask drawn on the whole input, as 1 process draws it. Packed rows of
    # 120 tokens: no padding to a multiple of 2.
    recipe = ("lora_finetune_distributed", "tiny/dora", phi3_base, f"lora.targets={TARGETS}",
              "lora.dropout=0.1", "checkpoint.save_every_n_steps=null")  # fmt: skip
    one = _run(tmp_path / "one", *recipe, nproc=1)
    tp2 = _run(tmp_path / "tp2", *recipe, TP2, nproc=2)
    _assert_same_training(tp2, one, steps=range(1, STEPS + 1))
    assert_same_exports(tp2, one, atol=TIGHT_EXPORT_TOLERANCE)
    adapter = load_file(tp2 / "epoch_0" / "adapter" / "adapter_model.safetensors")
    assert any(".qkv_proj.lora_magnitude_vector" in key for key in adapter)


@pytest.mark.slow
def test_qlora_tp2_equals_one_process(tmp_path):
    # A Phi-3 whose fused weights split 2 ways into whole NF4 scale groups (hidden 256, 4 heads
    # of 64: each rank's 384 rows of qkv_proj are 6 groups of 16384 values), so every linear
    # weight but lm_head is quantized on each rank's own rows (none kept in the training dtype).
    transformers = pytest.importorskip("transformers")
    tiny = assets_dir() / "tiny"
    ids = json.loads((tiny / "config.json").read_text())
    config = transformers.Phi3Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=ids["vocab_size"], bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
        initializer_range=0.05, max_position_embeddings=256,
        original_max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    base = tmp_path / "base"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny / name, base / name)
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    for out, extra, nproc in ((one, (), 1), (tp2, (TP2,), 2)):
        result = tunelab_run(
            "lora_finetune_distributed", "tiny/qlora", f"output_dir={out}", f"model.path={base}",
            *SETTINGS, f"lora.targets={TARGETS}", "checkpoint.save_every_n_steps=null", *extra,
            nproc=nproc,
        )  # fmt: skip
        assert "kept in the training dtype" not in result.stdout + result.stderr
    _assert_same_training(tp2, one, steps=range(1, STEPS + 1))
    assert_same_exports(tp2, one, atol=TIGHT_EXPORT_TOLERANCE)
