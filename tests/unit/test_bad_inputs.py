"""Every bad input gets one clear error before work starts.

A table of mistakes: each row is a `tunelab` command line (or a recipe's own command line) and
the pieces its one error message must contain: the key, the file or the name, the value and what
is allowed. Every row must exit non-zero without a traceback, before any process starts. Add a
row to cover a new mistake; `{placeholders}` name the files the `workspace` fixture builds.

Most rows call `tunelab.cli.main.main` in this process (fast); a few at the end run the real
`tunelab` entry point in a subprocess, and check that `tunelab validate` never imports torch.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tunelab import _paths
from tunelab.cli.main import main
from tunelab.config.recipe_args import LoRAFinetuneArgs
from tunelab.formats import integrity, layout
from tunelab.lifecycle import recipe_main

TINY = _paths.assets_dir() / "tiny"
TUNELAB = Path(sys.executable).with_name("tunelab")
ENV = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
ENV.pop("TUNELAB_DEBUG", None)


@dataclass(frozen=True)
class Case:
    """One bad input: the command line and what its message must contain."""

    id: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]
    code: int = 1


def lora(*overrides: str) -> tuple[str, ...]:
    """`tunelab validate tiny/lora` with overrides (output_dir in the test's folder)."""
    return ("validate", "tiny/lora", "output_dir={tmp}/out", *overrides)


def generate(*overrides: str) -> tuple[str, ...]:
    return ("validate", "tiny/generate", *overrides)


def recipe(*overrides: str) -> tuple[str, ...]:
    """The recipe's own command line (`recipe.py --config ...`), parsed by recipe_main."""
    return ("@recipe", "--config", "tiny/lora", "output_dir={tmp}/out", *overrides)


def model(name: str) -> tuple[str, ...]:
    return lora(f"model.path={{models}}/{name}")


CASES = [
    # --- resume against what output_dir holds ------------------------------------------------
    Case(
        "fresh run into used output_dir",
        ("validate", "tiny/lora", "output_dir={tmp}/out"),
        ("output_dir {tmp}/out already holds committed checkpoints (step_2)", "resume_from"),
    ),
    Case(
        "resume=true with nothing to resume",
        lora("checkpoint.resume_from_checkpoint=true", "output_dir={tmp}/empty"),
        ("resume_from_checkpoint=true but {tmp}/empty holds no committed checkpoint", "auto"),
    ),
    # --- config values: ranges, types, sets ---------------------------------------------------
    Case(
        "schedule.batch_size=0",
        lora("schedule.batch_size=0"),
        ("key 'schedule.batch_size'", "expected int >= 1, got 0"),
    ),
    Case("lora.rank=0", lora("lora.rank=0"), ("key 'lora.rank'", "int >= 1", "got 0")),
    Case(
        "keep_last_n=0",
        lora("checkpoint.keep_last_n_checkpoints=0"),
        ("key 'checkpoint.keep_last_n_checkpoints'", "int >= 1 | None", "got 0"),
    ),
    Case(
        "grad_accum=0",
        lora("schedule.gradient_accumulation_steps=0"),
        ("key 'schedule.gradient_accumulation_steps'", ">= 1", "got 0"),
    ),
    Case(
        "lr=fast",
        lora("optimizer.lr=fast"),
        ("key 'optimizer.lr'", "expected finite float > 0", "'fast'"),
    ),
    Case("lr=-1", lora("optimizer.lr=-1"), ("key 'optimizer.lr'", "finite float > 0", "got -1")),
    Case("lr=nan", lora("optimizer.lr=nan"), ("key 'optimizer.lr'", "finite float > 0", "nan")),
    Case("lr=.nan", lora("optimizer.lr=.nan"), ("key 'optimizer.lr'", "finite", "got nan")),
    Case("lr=.inf", lora("optimizer.lr=.inf"), ("key 'optimizer.lr'", "finite", "got inf")),
    Case(
        "clip=-1",
        lora("schedule.clip_grad_norm=-1"),
        ("key 'schedule.clip_grad_norm'", "> 0", "got -1"),
    ),
    Case(
        "save_every=-5",
        lora("checkpoint.save_every_n_steps=-5"),
        ("key 'checkpoint.save_every_n_steps'", ">= 1", "got -5"),
    ),
    Case(
        "log_every=0",
        lora("schedule.log_every_n_steps=0"),
        ("key 'schedule.log_every_n_steps'", ">= 1", "got 0"),
    ),
    Case("output_dir=", lora("output_dir="), ("key 'output_dir'", "non-empty str", "got ''")),
    Case(
        "schedule.epochs=0",
        lora("schedule.epochs=0"),
        ("key 'schedule.epochs'", "expected int >= 1, got 0"),
    ),
    Case(
        "schedule.epochs=two",
        lora("schedule.epochs=two"),
        ("key 'schedule.epochs'", "int >= 1", "str 'two'"),
    ),
    Case(
        "max_steps=0",
        lora("schedule.max_steps_per_epoch=0"),
        ("key 'schedule.max_steps_per_epoch'", ">= 1", "got 0"),
    ),
    Case("dropout=1.5", lora("lora.dropout=1.5"), ("key 'lora.dropout'", "in [0, 1)", "got 1.5")),
    Case("alpha=0", lora("lora.alpha=0"), ("key 'lora.alpha'", "> 0", "got 0")),
    Case("targets=[]", lora("lora.targets=[]"), ("key 'lora.targets'", "non-empty", "got []")),
    Case(
        "model.dtype=fp16",
        lora("model.dtype=fp16"),
        ("key 'model.dtype'", "'fp32' | 'bf16'", "'fp16'"),
    ),
    Case(
        "export_every=0",
        lora("checkpoint.export_every_n_epochs=0"),
        ("key 'checkpoint.export_every_n_epochs'", ">= 1"),
    ),
    Case(
        "run_val_every=0",
        lora("schedule.run_val_every_n_steps=0"),
        ("key 'schedule.run_val_every_n_steps'", ">= 1", "got 0"),
    ),
    Case(
        "betas",
        lora("optimizer.betas=[0.9, 1.0]"),
        ("key 'optimizer.betas'", "in [0, 1)", "got 1.0"),
    ),
    Case(
        "weight_decay=-0.1",
        lora("optimizer.weight_decay=-0.1"),
        ("key 'optimizer.weight_decay'", ">= 0", "got -0.1"),
    ),
    Case("eps=0", lora("optimizer.eps=0"), ("key 'optimizer.eps'", "> 0", "got 0")),
    Case(
        "warmup=-1",
        lora("lr_scheduler.num_warmup_steps=-1"),
        ("key 'lr_scheduler.num_warmup_steps'", "int >= 0", "got -1"),
    ),
    Case(
        "template typo",
        lora("dataset.template=lama3"),
        ("key 'dataset.template'", "one of", "'lama3'", "did you mean 'llama3'"),
    ),
    Case(
        "dataset max_seq_len=0",
        lora("dataset.max_seq_len=0"),
        ("key 'dataset.max_seq_len'", ">= 1", "got 0"),
    ),
    Case(
        "tokenizer max_seq_len=0",
        lora("tokenizer.max_seq_len=0"),
        ("key 'tokenizer.max_seq_len'", ">= 1"),
    ),
    Case("num_chunks=0", lora("loss.num_chunks=0"), ("key 'loss.num_chunks'", ">= 1", "got 0")),
    Case(
        "log_dir empty",
        lora("metric_loggers.0.log_dir="),
        ("key 'metric_loggers.0.log_dir'", "non-empty"),
    ),
    Case(
        "wrong section",
        lora("save_every_n_steps=3"),
        ("unknown key 'save_every_n_steps'", "did you mean 'checkpoint.save_every_n_steps'"),
    ),
    Case(
        "optimizer typo",
        lora("optimiser.lr=1"),
        ("unknown key 'optimiser'", "did you mean 'optimizer'"),
    ),
    Case(
        "component arg typo",
        lora("optimizer.lrr=1"),
        ("key 'optimizer.lrr'", "has no argument 'lrr'", "did you mean 'optimizer.lr'"),
    ),
    Case(
        "component typo",
        lora("optimizer._component_=tunelab.training.adamx"),
        ("optimizer._component_", "'tunelab.training.adamx'", "tunelab.training.adamw"),
    ),
    Case(
        "loader without data_files",
        lora("~dataset.data_files"),
        ("key 'dataset.data_files'", "source 'json' needs data_files"),
    ),
    Case("max_new_tokens=0", generate("max_new_tokens=0"), ("key 'max_new_tokens'", ">= 1")),
    Case("temperature=-1", generate("temperature=-1"), ("key 'temperature'", ">= 0", "got -1")),
    Case("top_k=0", generate("top_k=0"), ("key 'top_k'", ">= 1", "got 0")),
    Case(
        "generate template",
        generate("template=chatlm"),
        ("key 'template'", "'chatlm'", "did you mean 'chatml'"),
    ),
    # --- paths -----------------------------------------------------------------------------------
    Case(
        "model folder missing",
        lora("model.path={tmp}/nowhere/Llama-3.2-1B"),
        (
            "key 'model.path'",
            "model folder not found: {tmp}/nowhere/Llama-3.2-1B",
            "tunelab download meta-llama/Llama-3.2-1B --output-dir {tmp}/nowhere/Llama-3.2-1B",
        ),
    ),
    Case(
        "model folder unknown name",
        lora("model.path={tmp}/nowhere/my-model"),
        ("key 'model.path'", "not found", "tunelab download <org>/<model>"),
    ),
    Case(
        "model folder typo",
        lora("model.path={assets}/tinny"),
        ("key 'model.path'", "not found", "did you mean '{assets}/tiny'? If not, download"),
    ),
    Case(
        "model folder is a file",
        lora("model.path={file}"),
        ("key 'model.path'", "{file} is a file"),
    ),
    Case(
        "dataset file typo",
        lora("dataset.data_files={assets}/tiny/sft.jsnol"),
        ("key 'dataset.data_files'", "sft.jsnol", "did you mean '{assets}/tiny/sft.jsonl'"),
    ),
    Case(
        "dataset source file missing",
        lora("dataset.source={tmp}/rows.jsonl", "~dataset.data_files"),
        ("key 'dataset.source'", "data file not found: {tmp}/rows.jsonl"),
    ),
    Case(
        "val dataset list missing file",
        lora("val_dataset.data_files=[{assets}/tiny/sft_val.jsonl, {tmp}/gone.jsonl]"),
        ("key 'val_dataset.data_files'", "{tmp}/gone.jsonl"),
    ),
    Case(
        "output_dir is a file",
        lora("output_dir={file}"),
        ("key 'output_dir'", "{file} is a file, expected a folder"),
    ),
    Case(
        "output_dir under a file",
        lora("output_dir={file}/run"),
        ("key 'output_dir'", "cannot create {file}/run", "{file} is a file"),
    ),
    Case(
        "adapter_dir missing",
        lora("adapter_dir={tmp}/adapter"),
        ("key 'adapter_dir'", "folder not found: {tmp}/adapter"),
    ),
    Case(
        "adapter_dir without files",
        generate("adapter_dir={tmp}"),
        ("key 'adapter_dir'", "has no adapter_config.json"),
    ),
    Case(
        "tokenizer path missing",
        lora("tokenizer.path={tmp}/tok"),
        ("key 'tokenizer.path'", "tokenizer folder not found: {tmp}/tok"),
    ),
    Case(
        "tokenizer folder without tokenizer.json",
        lora("tokenizer.path={tmp}"),
        ("key 'tokenizer.path'", "has no tokenizer.json"),
    ),
    # --- model files and tokenizers ----------------------------------------------------------
    Case(
        "no weights",
        model("no_weights"),
        ("key 'model.path'", "no_weights has no *.safetensors weights", "tunelab download"),
    ),
    Case(
        "pickled weights only",
        model("bin_only"),
        ("key 'model.path'", "only pickled weights (pytorch_model.bin)", "safetensors"),
    ),
    Case(
        "unsupported model_type",
        model("gpt2"),
        ("key 'model.path'", "config.json", "model_type 'gpt2' is not supported", "llama"),
    ),
    Case(
        "config.json not JSON",
        model("bad_json"),
        ("key 'model.path'", "bad_json/config.json is not valid JSON", "line 1"),
    ),
    Case(
        "no config.json",
        model("no_config"),
        ("key 'model.path'", "no_config has no config.json"),
    ),
    Case(
        "no tokenizer.json",
        model("no_tokenizer"),
        ("key 'model.path'", "no_tokenizer has no tokenizer.json"),
    ),
    Case(
        "truncated weights",
        model("truncated"),
        ("key 'model.path'", "truncated/model.safetensors is truncated"),
    ),
    Case(
        "index names a missing shard",
        model("missing_shard"),
        ("key 'model.path'", "model.safetensors.index.json", "model-00002-of-00002"),
    ),
    Case(
        "token ids >= vocab_size",
        model("small_vocab"),
        ("key 'model.path'", "tokenizer.json does not fit", "vocab_size 500", "largest: 809"),
    ),
    Case(
        "vocab_size missing",
        model("no_vocab_size"),
        ("key 'model.path'", "vocab_size must be a positive integer", "None"),
    ),
    Case(
        "eos id beyond vocab",
        model("eos_id"),
        ("key 'model.path'", "eos_token_id 5000 is not below vocab_size 810"),
    ),
    Case(
        "special token not in vocab",
        model("bad_special"),
        ("key 'model.path'", "tokenizer_config.json", "eos_token '<|eos|>' is not in"),
    ),
    Case(
        "tokenizer.json not JSON",
        model("bad_tokenizer"),
        ("key 'model.path'", "bad_tokenizer/tokenizer.json is not valid JSON"),
    ),
    Case(
        "tokenizer elsewhere too large",
        lora("tokenizer.path={models}/big_tokenizer"),
        ("key 'tokenizer.path'", "does not fit", "vocab_size 810", "largest: 900"),
    ),
    Case(
        "an output_dir as model",
        generate("model.path={models}/run"),
        ("key 'model.path'", "run has no config.json", "exports epoch_0, epoch_1"),
    ),
    Case(
        "a step checkpoint as model",
        generate("model.path={models}/run/step_4"),
        ("key 'model.path'", "step_4 has no config.json", "resumable step checkpoint"),
    ),
    Case(
        "an adapter as model",
        generate("model.path={models}/run/epoch_1/adapter"),
        ("key 'model.path'", "adapter has no config.json", "pass it as adapter_dir"),
    ),
    Case(
        "generate on a gpt2 folder",
        generate("model.path={models}/gpt2"),
        ("key 'model.path'", "model_type 'gpt2' is not supported"),
    ),
    # --- the recipe's own command line (recipe_main -> parse_args) ------------------------------
    Case(
        "recipe batch_size=0",
        recipe("schedule.batch_size=0"),
        ("key 'schedule.batch_size'", "got 0"),
    ),
    Case(
        "recipe model folder",
        recipe("model.path={models}/bin_only"),
        ("key 'model.path'", "only pickled weights"),
    ),
    # --- command-line arguments --------------------------------------------------------------
    Case(
        "cp name typo", ("cp", "tiny/lroa", "{tmp}/x"), ("'tiny/lroa'", "did you mean 'tiny/lora'")
    ),
    Case(
        "cp recipe typo",
        ("cp", "lora_finetune_distributd", "-"),
        ("did you mean 'lora_finetune_distributed'",),
    ),
    Case(
        "cp onto a file",
        ("cp", "tiny/lora", "{file}"),
        ("{file} already exists", "--force"),
    ),
    Case("validate config typo", ("validate", "tiny/lroa"), ("did you mean 'tiny/lora'",)),
    Case(
        "validate a recipe name",
        ("validate", "lora_finetune_distributed"),
        ("'lora_finetune_distributed' is a recipe, not a config",),
    ),
    Case(
        "validate file typo",
        ("validate", "{configs}/tiny/lroa.yaml"),
        ("config file not found", "did you mean '{configs}/tiny/lora.yaml'"),
    ),
    Case(
        "validate --recipe typo",
        ("validate", "tiny/lora", "--recipe", "lora_finetune_distributd"),
        ("unknown recipe 'lora_finetune_distributd'", "did you mean"),
    ),
    Case(
        "run recipe typo",
        ("run", "lora_finetune_distributd", "--config", "tiny/lora"),
        ("unknown recipe", "did you mean 'lora_finetune_distributed'"),
    ),
    Case(
        "run config typo",
        ("run", "lora_finetune_distributed", "--config", "tiny/lroa"),
        ("unknown config 'tiny/lroa'", "did you mean 'tiny/lora'"),
    ),
    Case(
        "run a config as recipe",
        ("run", "tiny/lora", "--config", "tiny/lora"),
        ("'tiny/lora' is a config, not a recipe", "tunelab run lora_finetune_distributed"),
    ),
    Case(
        "run recipe path typo",
        ("run", "{recipes}/lora_finetune_distributd.py", "--config", "tiny/lora"),
        ("recipe file not found", "did you mean '{recipes}/lora_finetune_distributed.py'"),
    ),
    Case(
        "run validates values first",
        (
            "run",
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
            "output_dir={tmp}/o",
            "schedule.epochs=0",
        ),
        ("key 'schedule.epochs'", "got 0"),
    ),
    Case("override without =", lora("batch_size"), ("bad override 'batch_size'",)),
    Case("delete missing key", lora("~no_such_key"), ("'~no_such_key'", "no key 'no_such_key'")),
    Case(
        "config recipe key typo",
        ("validate", "{tmp}/bad_recipe.yaml"),
        ("key 'recipe'", "did you mean 'lora_finetune_distributed'"),
    ),
    Case("malformed YAML", ("validate", "{tmp}/broken.yaml"), ("broken.yaml", "line 3")),
    Case("cp without DEST", ("cp", "tiny/lora"), ("DEST",), code=2),
]


def _write_model(root: Path, name: str, **changes) -> Path:
    """A copy of the tiny model folder with files replaced or removed.

    Copied, weights included: a link out of a model folder is refused (issue 23).
    """
    folder = root / name
    folder.mkdir()
    for source in TINY.iterdir():
        if source.suffix == ".jsonl":
            continue
        shutil.copyfile(source, folder / source.name)
    config = json.loads((TINY / "config.json").read_text())
    for key, value in changes.pop("config", {}).items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    for file_name, content in changes.items():
        path = folder / file_name.replace("__", ".")
        if path.is_symlink() or path.exists():
            path.unlink()
        if content is not None:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The files the cases name, as format placeholders."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    models = tmp / "models"
    models.mkdir()
    weights = (TINY / "model.safetensors").read_bytes()
    tokenizer = json.loads((TINY / "tokenizer.json").read_text())
    _write_model(models, "no_weights", model__safetensors=None)
    _write_model(models, "bin_only", model__safetensors=None, pytorch_model__bin=b"\x80pickle")
    _write_model(
        models, "gpt2", config={"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    )
    _write_model(models, "bad_json", config__json="{not json")
    _write_model(models, "no_config", config__json=None)
    _write_model(models, "no_tokenizer", tokenizer__json=None)
    _write_model(models, "truncated", model__safetensors=weights[: len(weights) // 2])
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    _write_model(
        models,
        "missing_shard",
        model__safetensors=None,
        **{"model-00001-of-00002__safetensors": weights},
        model__safetensors__index__json=json.dumps(index),
    )
    _write_model(models, "small_vocab", config={"vocab_size": 500})
    _write_model(models, "no_vocab_size", config={"vocab_size": None})
    _write_model(models, "eos_id", config={"eos_token_id": [1, 5000]})
    tokenizer_config = json.loads((TINY / "tokenizer_config.json").read_text())
    _write_model(
        models,
        "bad_special",
        tokenizer_config__json=json.dumps({**tokenizer_config, "eos_token": "<|eos|>"}),
    )
    _write_model(models, "bad_tokenizer", tokenizer__json="{")
    big = models / "big_tokenizer"
    big.mkdir()
    added = [
        *tokenizer["added_tokens"],
        {**tokenizer["added_tokens"][-1], "id": 900, "content": "<|x|>"},
    ]
    (big / "tokenizer.json").write_text(json.dumps({**tokenizer, "added_tokens": added}))
    run = models / "run"  # What a training run leaves: step checkpoints and exports.
    for export in ("epoch_0", "epoch_1"):
        (run / export / "adapter").mkdir(parents=True)
        (run / export / "config.json").write_text("{}")
        (run / export / "adapter" / "adapter_config.json").write_text("{}")
    (run / "step_4").mkdir()
    (run / "step_4" / ".metadata").write_bytes(b"")
    (tmp / "a_file").write_text("not a folder\n")
    # The output_dir the cases name already holds a committed checkpoint (with checksums):
    # no bad input may touch it.
    step = tmp / "out" / "step_2"
    step.mkdir(parents=True)
    records = {
        name: integrity.write_bytes(step / name, payload)
        for name, payload in (("__0_0.distcp", b"\x01" * 64), ("trainer_state.json", b"{}"))
    }
    layout.write_manifest(step, records, step=2, epoch=0)
    (tmp / "bad_recipe.yaml").write_text("recipe: lora_finetune_distributd\n")
    (tmp / "broken.yaml").write_text("recipe: x\nbatch_size: [1,\n")
    return {
        "tmp": str(tmp),
        "models": str(models),
        "file": str(tmp / "a_file"),
        "assets": str(_paths.assets_dir()),
        "configs": str(_paths.configs_dir()),
        "recipes": str(_paths.recipes_dir()),
    }


def _never_called(args) -> None:
    raise AssertionError("the recipe ran although its config is bad")


def run_in_process(argv: list[str]) -> int:
    if argv[0] == "@recipe":
        with pytest.raises(SystemExit) as info:
            recipe_main(_never_called, LoRAFinetuneArgs, argv[1:])
    else:
        with pytest.raises(SystemExit) as info:
            main(argv)
    return info.value.code


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 45
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gets_one_clear_error(case, workspace, capsys, monkeypatch):
    monkeypatch.chdir(workspace["tmp"])
    monkeypatch.delenv("TUNELAB_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    argv = [arg.format(**workspace) for arg in case.argv]
    code = run_in_process(argv)
    out, err = capsys.readouterr()
    assert code == case.code, err
    assert "Traceback" not in out + err
    if case.code == 1:
        assert err.startswith("tunelab: error: "), err
    for piece in case.expect:
        assert piece.format(**workspace) in err, err
    # Validation starts no process and creates nothing (run would have made output_dir).
    assert not (Path(workspace["tmp"]) / "o").exists()
    # The committed checkpoint in output_dir is byte-identical (its checksums still match).
    step = Path(workspace["tmp"]) / "out" / "step_2"
    assert integrity.verify_folder(step) == [] and sorted(os.listdir(step)) == [
        "__0_0.distcp",
        "trainer_state.json",
        "tunelab_manifest.json",
    ]


SUBPROCESS_CASES = [
    ("validate", "tiny/lora", "schedule.batch_size=0"),
    ("validate", "tiny/lora", "model.path=/nonexistent/Qwen2.5-7B"),
    ("run", "lora_finetune_distributed", "--config", "tiny/lora", "lora.rank=0"),
]


@pytest.mark.parametrize("argv", SUBPROCESS_CASES, ids=[" ".join(a[:3]) for a in SUBPROCESS_CASES])
def test_real_entry_point_gives_one_line(argv, tmp_path):
    result = subprocess.run(
        [str(TUNELAB), *argv], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunelab: error: key '"), result.stderr
    assert list(tmp_path.iterdir()) == []  # Nothing launched, nothing written.


def test_validate_is_fast_and_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from tunelab.cli.main import main\n"
        "try:\n"
        "    main(['validate', 'tiny/lora', 'output_dir=out'])\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'torch' in sys.modules)\n"
    )
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=tmp_path
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 False", result.stdout
    # Measured at ~0.2 s (it was ~2.5 s when validation imported the recipes and torch).
    assert elapsed < 2.0
