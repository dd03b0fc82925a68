"""Preference pairs and GRPO prompts with tool calls, tool results and reasoning, against
transformers' ``apply_chat_template(..., tools=...)``.

The rows go through the real data path (JSON Lines files read by ``preference_dataset`` and
``prompt_dataset``, ``arguments`` as JSON text); transformers renders the messages
``read_conversation`` makes of the same turns, with the same ``tools``. For each real template
(tests/chat_templates):

- a pair's sides have the ids of ``apply_chat_template(prompt + answer, tools=...)``;
- the trained text of a side is exactly what the model generates for the answer:
  ``render(prompt + answer)`` after ``render(prompt, add_generation_prompt=True)``, to its stop
  token; the prompt's tool call, the tool result and the system prompt are never trained;
- with ``{% generation %}`` blocks the mask is ``return_assistant_tokens_mask`` on the answer;
- a GRPO prompt's ids are ``apply_chat_template(prompt, tools=..., add_generation_prompt=True)``.
"""

import json

import pytest

from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tests.interop.test_chat_tools_hf import (
    KWARGS,
    SYSTEM,
    TOOLS,
    call,
    generated_by_transformers,
    hf_ids,
    trained_runs,
)
from tunelab.data import load_tokenizer, preference_dataset
from tunelab.data.conversations import read_conversation
from tunelab.data.prompts import prompt_dataset
from tunelab.data.rows import IGNORE_INDEX
from tunelab.errors import DataError

transformers = pytest.importorskip("transformers")

RESULT = '{"temperature": 22}'
# The prompt ends with a tool call and its result; the answers differ in what they do next.
PROMPT = [
    SYSTEM,
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "A lookup.",
        "tool_calls": [call("call00001", "get_weather", '{"location": "Paris"}')],
    },
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": RESULT},
]
CHOSEN = [
    {"role": "assistant", "content": "Sunny and 22 degrees.", "reasoning_content": "Answered."}
]
REJECTED = [
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Again.",
        "tool_calls": [call("call00002", "get_time", '{"city": "Rome"}')],
    }
]
NAMES = ["llama3_2", "qwen2_5", "qwen3", "qwen3_training", "mistral_nemo"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_tools_hf")
    folders = {name: make_tokenizer_dir(root / name, SPECS[name]) for name in NAMES}
    return {
        name: (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
        for name, folder in folders.items()
    }


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("name", NAMES)
def test_preference_pair_with_tools_trains_what_transformers_renders(pairs, name, tmp_path):
    tok, hf_tok = pairs[name]
    row = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED, "tools": TOOLS}
    source = write_rows(tmp_path / "pairs.jsonl", [row])
    options = dict(template_kwargs=KWARGS, cache_dir=str(tmp_path / "cache"))
    (item,) = list(preference_dataset(tok, source=source, **options))
    prompt = read_conversation(PROMPT, "prompt")
    for side, answer in (("chosen", CHOSEN), ("rejected", REJECTED)):
        messages = prompt + read_conversation(answer, side)
        ids, labels = item[f"{side}_tokens"], item[f"{side}_labels"]
        assert ids == hf_ids(hf_tok, messages, tools=TOOLS, **KWARGS), side
        mask = [label == IGNORE_INDEX for label in labels]
        served, generated = generated_by_transformers(
            tok, hf_tok, messages, len(prompt), tools=TOOLS, **KWARGS
        )
        assert tok.decode(ids, skip_special_tokens=False).startswith(served + generated)
        trained = "".join(trained_runs(tok, ids, mask))
        if name == "qwen3_training":  # its generation block also holds the newline after it
            assert trained == generated + "\n", side
        else:
            assert trained == generated, side
        for never in (RESULT, "You are a helpful", "Paris"):
            assert never not in trained
    # The answers' own calls are trained: the rejected side's call names Rome.
    assert "Rome" in "".join(
        trained_runs(
            tok, item["rejected_tokens"], [x == IGNORE_INDEX for x in item["rejected_labels"]]
        )
    )


def test_preference_mask_is_return_assistant_tokens_mask_on_the_answer(pairs, tmp_path):
    tok, hf_tok = pairs["qwen3_training"]
    row = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED, "tools": TOOLS}
    source = write_rows(tmp_path / "pairs.jsonl", [row])
    (item,) = list(preference_dataset(tok, source=source, cache_dir=str(tmp_path / "cache")))
    prompt = read_conversation(PROMPT, "prompt")
    messages = prompt + read_conversation(CHOSEN, "chosen")
    out = hf_tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert item["chosen_tokens"] == list(out["input_ids"])
    # transformers marks every assistant turn; a pair trains its answer only.
    served = len(hf_ids(hf_tok, prompt, tools=TOOLS, add_generation_prompt=True))
    expected = [0] * served + list(out["assistant_masks"])[served:]
    assert [int(label != IGNORE_INDEX) for label in item["chosen_labels"]] == expected
    assert sum(expected) > 0 and sum(out["assistant_masks"][:served]) > 0


def test_preference_pair_without_prompt_column_shares_the_tool_turns(pairs, tmp_path):
    # Anthropic HH's layout: whole conversations whose common start is the prompt.
    tok, hf_tok = pairs["qwen2_5"]
    rows = [{"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED, "tools": TOOLS}]
    source = write_rows(tmp_path / "pairs.jsonl", rows)
    (item,) = list(preference_dataset(tok, source=source, cache_dir=str(tmp_path / "cache")))
    messages = read_conversation(PROMPT + CHOSEN, "chosen")
    assert item["chosen_tokens"] == hf_ids(hf_tok, messages, tools=TOOLS)
    trained = tok.decode(
        [
            t
            for t, label in zip(item["chosen_tokens"], item["chosen_labels"])
            if label != IGNORE_INDEX
        ]
    )
    assert trained.startswith("Sunny and 22 degrees.") and "Paris" not in trained


@pytest.mark.parametrize("name", NAMES)
def test_grpo_prompt_with_tools_is_the_served_prompt(pairs, name, tmp_path):
    tok, hf_tok = pairs[name]
    rows = [
        {"prompt": PROMPT, "tools": TOOLS, "answer": "22"},
        {"prompt": "What is 2 + 2?", "answer": "4"},
    ]
    source = write_rows(tmp_path / "prompts.jsonl", rows)
    dataset = prompt_dataset(tok, source=source, template_kwargs=KWARGS)
    messages = read_conversation(PROMPT + CHOSEN, "prompt")[: len(PROMPT)]
    expected = hf_ids(hf_tok, messages, tools=TOOLS, add_generation_prompt=True, **KWARGS)
    assert dataset[0]["prompt_tokens"] == expected
    # The call and its result are in the prompt (each template quotes them its own way).
    assert "Paris" in dataset.prompts[0] and "temperature" in dataset.prompts[0]
    plain = [{"role": "user", "content": "What is 2 + 2?"}]
    assert dataset[1]["prompt_tokens"] == hf_ids(
        hf_tok, plain, add_generation_prompt=True, **KWARGS
    )
    assert dataset.rows[0]["answer"] == "22"


def test_bad_tool_rows_are_one_error_naming_the_row(pairs, tmp_path):
    tok, _ = pairs["qwen2_5"]
    orphan = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": RESULT}]
    bad_arguments = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call("c", "get_time", "{city")]},
    ]
    good = {"prompt": "Hi", "chosen": "Hello.", "rejected": "Bye."}
    source = write_rows(tmp_path / "pairs.jsonl", [good, {**good, "prompt": orphan}])
    with pytest.raises(
        DataError, match=r"pairs\.jsonl:2: row 1.*prompt.*tool message with no matching call"
    ):
        preference_dataset(tok, source=source, cache_dir=str(tmp_path / "cache"))
    # In an answer, the index counts from the answer's first message.
    wrong_id = {"role": "tool", "tool_call_id": "call00009", "content": RESULT}
    answer = [wrong_id, {"role": "assistant", "content": "Sunny."}]
    source = write_rows(tmp_path / "answer.jsonl", [{**good, "prompt": PROMPT, "chosen": answer}])
    with pytest.raises(
        DataError, match=r"answer\.jsonl:1: row 0.*'chosen': message 0: .*'call00009'; the calls"
    ):
        preference_dataset(tok, source=source, cache_dir=str(tmp_path / "cache"))
    source = write_rows(tmp_path / "prompts.jsonl", [{"prompt": bad_arguments}])
    with pytest.raises(
        DataError,
        match=r"prompts\.jsonl:1: row 0 \(0-based\), column 'prompt': .*arguments: not valid JSON",
    ):
        prompt_dataset(tok, source=source)
    # A named format (a base model's) takes plain messages only.
    source = write_rows(tmp_path / "tools.jsonl", [{**good, "prompt": PROMPT}])
    with pytest.raises(DataError, match=r"tools\.jsonl:1: row 0"):
        preference_dataset(tok, source=source, template="chatml", cache_dir=str(tmp_path / "c2"))
