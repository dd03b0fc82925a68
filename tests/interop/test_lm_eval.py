"""tunelab's lm-eval model against lm-eval's own ``hf`` backend (transformers) on one tiny export.

The model is a random-init tiny Llama saved by transformers with the embedded tiny tokenizer;
the tasks are written here as task YAML over local JSONL (one multiple-choice, one
generate_until), so nothing needs a network. Per document: log-likelihoods within 1e-4, the
same greedy flags and the same generations; per task: the same accuracy. Also: base + PEFT
adapter scores as the merged export, and 2 processes (`tunelab run eval`) as 1.
"""

import json
import random
import shutil
import subprocess
import time

import pytest
import torch

from tests.conftest import build_tiny_hf_model
from tests.recipes.conftest import RECIPE_TIMEOUT_S, TUNELAB, free_port, run_env
from tunelab import ConfigError, _paths

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

from tunelab.data import load_tokenizer  # noqa: E402
from tunelab.eval import TunelabLM, evaluate  # noqa: E402
from tunelab.models import load_pretrained  # noqa: E402

TINY = _paths.assets_dir() / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WORDS = "red cat sun blue milk bed car tree cup cake hat pen ship key lamp map".split()

MC_TASK = """task: t_next_number
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{numbers}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: t_repeat_words
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{words}}. {{words.split(' ')[0]}}"
doc_to_target: "{{' ' + words.split(' ', 1)[1]}}"
generation_kwargs:
  until: [".", "cake"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A random-init tiny Llama (transformers) with the tiny tokenizer, as an HF folder."""
    folder = tmp_path_factory.mktemp("lm_eval_export")
    # eos as the tokenizer's stop tokens (EOS, <|eot_id|>, <|im_end|>): both sides stop alike.
    model = build_tiny_hf_model(
        "llama3_2", vocab_size=810, bos_token_id=0, eos_token_id=[1, 5, 7], pad_token_id=2
    )
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two task YAMLs over JSONL beside them (relative data_files)."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    rng = random.Random(0)
    with open(folder / "mc.jsonl", "w") as file:
        for _ in range(10):
            n = rng.randrange(20, 900)
            choices = [str(n + 1), str(n + 2), str(n - 1), f"{n} {n + 1}"]
            rng.shuffle(choices)
            row = {
                "numbers": f"{n - 1} {n}",
                "choices": choices,
                "label": choices.index(str(n + 1)),
            }
            file.write(json.dumps(row) + "\n")
    with open(folder / "gen.jsonl", "w") as file:
        for _ in range(6):
            file.write(
                json.dumps({"words": " ".join(rng.sample(WORDS, rng.randrange(2, 6)))}) + "\n"
            )
    (folder / "mc.yaml").write_text(MC_TASK)
    (folder / "gen.yaml").write_text(GEN_TASK)
    return [str(folder / "mc.yaml"), str(folder / "gen.yaml")]


@pytest.fixture(scope="module")
def tunelab_lm(export):
    return TunelabLM(load_pretrained(export), load_tokenizer(export), batch_size=3)


@pytest.fixture(scope="module")
def hf_lm(export):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(export), dtype="float32", batch_size=3, device="cpu")


@pytest.fixture(scope="module")
def both_results(tunelab_lm, hf_lm, tasks):
    run = {"num_fewshot": 1, "log_samples": True}
    return evaluate(tunelab_lm, tasks, **run), evaluate(hf_lm, tasks, **run)


def _by_doc(results, task):
    return {sample["doc_id"]: sample for sample in results["samples"][task]}


def test_loglikelihoods_and_accuracy_equal_the_hf_backend(both_results):
    ours, theirs = both_results
    our_docs, their_docs = _by_doc(ours, "t_next_number"), _by_doc(theirs, "t_next_number")
    assert sorted(our_docs) == sorted(their_docs) == list(range(10))
    for doc_id, sample in our_docs.items():
        our_scores = [resp[0] for resp in sample["resps"]]
        their_scores = [resp[0] for resp in their_docs[doc_id]["resps"]]
        assert len(our_scores) == 4
        for (our_logp, our_greedy), (their_logp, their_greedy) in zip(our_scores, their_scores):
            assert our_logp == pytest.approx(their_logp, abs=1e-4)
            assert our_greedy == their_greedy
        assert sample["arguments"] == their_docs[doc_id]["arguments"]
    assert (
        ours["results"]["t_next_number"]["acc,none"]
        == theirs["results"]["t_next_number"]["acc,none"]
    )
    # Scores differ between choices (a test that can fail): the model is not constant.
    assert len({round(resp[0][0], 3) for resp in our_docs[0]["resps"]}) == 4


def test_greedy_generations_equal_the_hf_backend(both_results):
    ours, theirs = both_results
    our_docs, their_docs = _by_doc(ours, "t_repeat_words"), _by_doc(theirs, "t_repeat_words")
    ours_text = {doc_id: sample["resps"][0][0] for doc_id, sample in our_docs.items()}
    theirs_text = {doc_id: sample["resps"][0][0] for doc_id, sample in their_docs.items()}
    assert ours_text == theirs_text
    assert len(set(ours_text.values())) > 1, ours_text  # prompts lead to different completions
    assert all(text for text in ours_text.values())
    assert (
        ours["results"]["t_repeat_words"]["exact_match,none"]
        == theirs["results"]["t_repeat_words"]["exact_match,none"]
    )


def test_rolling_loglikelihood_over_several_windows_equals_the_hf_backend(tunelab_lm, hf_lm):
    texts = ["red cat sun blue milk bed car tree cup cake hat pen ship key lamp map " * 2, "7 8 9"]
    requests = [
        Instance("loglikelihood_rolling", {}, (text,), index) for index, text in enumerate(texts)
    ]
    hf_lm._max_length = 16
    tunelab_lm.max_length = 16  # windows of 16 tokens: the first text spans several
    try:
        ours = tunelab_lm.loglikelihood_rolling(requests)
        theirs = hf_lm.loglikelihood_rolling(requests)
    finally:
        tunelab_lm.max_length = tunelab_lm.model.args.max_seq_len
        hf_lm._max_length = None
    assert len(tunelab_lm.tok_encode(texts[0])) > 2 * 16  # three windows
    assert ours == pytest.approx(theirs, abs=1e-4)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_the_hf_backend(tunelab_lm, hf_lm, add_generation_prompt):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse: red cat"},
        {"role": "assistant", "content": "cat red"},
    ]
    if add_generation_prompt:
        chat = chat[:-1]
    ours = tunelab_lm.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert ours == hf_lm.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    # A templated prompt starts with the BOS text: no second BOS, as in the hf backend.
    assert tunelab_lm.tok_encode(ours) == hf_lm.tok_encode(ours)


def test_only_continuation_positions_reach_the_output_layer(tunelab_lm):
    rows = []
    original = tunelab_lm.model.output
    tunelab_lm.model.output = lambda hidden: rows.append(hidden.shape[0]) or original(hidden)
    try:
        context = tunelab_lm.tok_encode("red cat sun blue milk bed car tree")
        continuation = tunelab_lm.tok_encode(" cup cake", add_special_tokens=False)
        (score,) = tunelab_lm._loglikelihood_tokens([(None, context, continuation)])
    finally:
        del tunelab_lm.model.output
    assert rows == [len(continuation)]
    # The same score as the full logits of the whole sequence.
    with torch.no_grad():
        logits = tunelab_lm.model(torch.tensor([context + continuation]))[0]
    logps = torch.log_softmax(logits.double(), dim=-1)
    expected = sum(
        float(logps[len(context) - 1 + t, token]) for t, token in enumerate(continuation)
    )
    assert score[0] == pytest.approx(expected, abs=1e-5)


def test_a_task_that_needs_the_hub_offline_is_one_error_naming_it(
    tunelab_lm, tmp_path, monkeypatch
):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    task = tmp_path / "hub_task.yaml"
    task.write_text(
        MC_TASK.replace("t_next_number", "t_from_the_hub")
        .replace("dataset_path: json", "dataset_path: tunelab-tests/no-such-dataset")
        .replace("dataset_kwargs:\n  data_files:\n    test: mc.jsonl\n", "")
    )
    with pytest.raises(ConfigError, match="t_from_the_hub.*Hugging Face Hub"):
        evaluate(tunelab_lm, [str(task)], limit=2)
    with pytest.raises(ConfigError, match="no such task file"):
        evaluate(tunelab_lm, [str(tmp_path / "missing.yaml")])


def test_base_plus_adapter_scores_as_the_merged_export(export, tasks, tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    import tunelab.peft as tunelab_peft
    from tunelab.training import load_model

    base = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    adapted = peft.get_peft_model(base, config)
    adapted.save_pretrained(tmp_path / "adapter")
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, tmp_path / "merged" / name)
    adapter_dir = str(tmp_path / "adapter")
    lora = tunelab_peft.LoRAArgs.from_peft_config(tunelab_peft.read_adapter_config(adapter_dir))
    with_adapter = load_model(
        str(export),
        device=torch.device("cpu"),
        dtype=torch.float32,
        lora=lora,
        adapter_dir=adapter_dir,
    ).eval()
    tokenizer = load_tokenizer(export)
    merged_model = load_pretrained(tmp_path / "merged")
    on_base = evaluate(TunelabLM(with_adapter, tokenizer), tasks[:1], log_samples=True)
    merged = evaluate(TunelabLM(merged_model, tokenizer), tasks[:1], log_samples=True)
    plain = evaluate(TunelabLM(load_pretrained(export), tokenizer), tasks[:1], log_samples=True)
    scores = {
        name: [
            resp[0][0]
            for sample in _by_doc(run, "t_next_number").values()
            for resp in sample["resps"]
        ]
        for name, run in (("adapter", on_base), ("merged", merged), ("base", plain))
    }
    assert scores["adapter"] == pytest.approx(scores["merged"], abs=1e-4)
    assert scores["adapter"] != pytest.approx(scores["base"], abs=1e-2)  # the adapter acts
    key = "acc,none"
    assert on_base["results"]["t_next_number"][key] == merged["results"]["t_next_number"][key]


@pytest.mark.slow
def test_two_processes_give_the_results_of_one(export, tasks, tunelab_lm, tmp_path):
    # Zero-shot: lm-eval draws few-shot examples from one RNG stream in each rank's document
    # order, so with few-shot prompts the examples depend on the number of processes.
    one = evaluate(tunelab_lm, tasks, num_fewshot=0, log_samples=True)
    command = [TUNELAB, "run", "--nproc_per_node", "2", "eval", "--config", "tiny/eval"]
    overrides = [
        f"model.path={export}",
        f"tasks=[{tasks[0]},{tasks[1]}]",
        f"output_dir={tmp_path / 'out'}",
        "num_fewshot=0",
        "batch_size=2",
        "log_samples=true",
    ]
    result = subprocess.run(
        [*command, *overrides],
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=RECIPE_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "t_next_number" in result.stdout  # the table
    two = json.loads((tmp_path / "out" / "results.json").read_text())
    for task, metric in (("t_next_number", "acc,none"), ("t_repeat_words", "exact_match,none")):
        assert two["results"][task][metric] == one["results"][task][metric]
        rows = (tmp_path / "out" / f"samples_{task}.jsonl").read_text().splitlines()
        two_docs = {row["doc_id"]: row for row in map(json.loads, rows)}
        one_docs = _by_doc(one, task)
        assert sorted(two_docs) == sorted(one_docs)
        for doc_id, sample in one_docs.items():
            ours, theirs = sample["resps"], two_docs[doc_id]["resps"]
            if task == "t_repeat_words":
                assert ours == theirs
            else:
                for (a, a_greedy), (b, b_greedy) in ((x[0], y[0]) for x, y in zip(ours, theirs)):
                    assert a == pytest.approx(b, abs=1e-5) and a_greedy == b_greedy


def test_a_missing_task_file_is_one_line_from_the_recipe(tmp_path):
    result = subprocess.run(
        [TUNELAB, "run", "eval", "--config", "tiny/eval", f"output_dir={tmp_path / 'out'}",
         f"tasks=[{tmp_path / 'nope.yaml'}]"],
        capture_output=True, text=True, env=run_env(), timeout=RECIPE_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "nope.yaml" in result.stderr and "no such task file" in result.stderr


def test_a_hub_task_while_the_hub_cannot_be_reached_fails_at_once_with_one_line(tmp_path):
    """Issue 38: lm-eval's dataset load retried the hub for about 50 s, a line per retry.

    The hub is an endpoint nothing listens on (as on a machine without network, on any
    machine); offline mode is not set: tunelab finds out itself.
    """
    task = tmp_path / "hub_task.yaml"
    task.write_text(
        MC_TASK.replace("t_next_number", "t_from_the_hub")
        .replace("dataset_path: json", "dataset_path: tunelab-tests/no-such-dataset")
        .replace("dataset_kwargs:\n  data_files:\n    test: mc.jsonl\n", "")
    )
    env = run_env(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    start = time.monotonic()
    result = subprocess.run(
        [TUNELAB, "run", "eval", "--config", "tiny/eval", f"output_dir={tmp_path / 'out'}",
         f"tasks=[{task}]"],
        capture_output=True, text=True, env=env, timeout=RECIPE_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "Retrying" not in output, output[-3000:]
    # One line about the hub: the error, naming the task, the endpoint and what to do.
    (line,) = [line for line in output.splitlines() if "127.0.0.1" in line or "error" in line]
    expected = (
        "tunelab: error: task 't_from_the_hub': its dataset could not be loaded without the "
        "Hugging Face Hub (http://127.0.0.1:"
    )
    assert line.startswith(expected), line
    assert "cannot be reached" in line and "run once with network access" in line, line
    # The retries alone slept 2 x (1 + 2 + 4 + 8 + 8) s = 46 s; start-up takes 10-20 s here.
    assert elapsed < 40, elapsed
