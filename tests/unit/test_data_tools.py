"""Chat datasets with tool calls, tool results, reasoning, tools and documents; tokenizer fit.

The ids and masks are compared with transformers in tests/interop/test_chat_tools_hf.py; here
the dataset path: rows read from JSON Lines, bad rows named by ``file:line``, settings, and the
check that stops a tokenizer that does not fit the data.
"""

import io
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tunelab.cli import _data
from tunelab.data import chat_dataset, load_tokenizer, text_dataset
from tunelab.errors import DataError

TEMPLATES = Path(__file__).resolve().parents[1] / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


def tool_row(arguments='{"location": "Paris"}', call_id="call00001", result_id="call00001"):
    return {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": result_id, "content": '{"temperature": 22}'},
            {"role": "assistant", "content": "Sunny and 22 degrees."},
        ],
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_tokenizers")
    names = ("qwen2_5", "qwen3", "phi3_5")
    return {name: load_tokenizer(make_tokenizer_dir(root / name, SPECS[name])) for name in names}


def trained_text(tok, item):
    return tok.decode([t for t in item["labels"] if t != -100], skip_special_tokens=False)


def test_tool_rows_train_calls_and_replies_never_results(tmp_path, tokenizers):
    tok = tokenizers["qwen2_5"]
    # tools as JSON text (LLaMA-Factory's layout) is read like the list.
    as_text = {**tool_row(), "tools": json.dumps([WEATHER])}
    # An empty tool_calls list on a plain reply (as exports write it) means no calls.
    empty_calls = tool_row()
    empty_calls["messages"][-1]["tool_calls"] = []
    path = write_jsonl(tmp_path / "tools.jsonl", [tool_row(), as_text, empty_calls])
    ds = chat_dataset(tok, source=path, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 3 and ds[0] == ds[1] == ds[2]
    text = tok.decode(ds[0]["tokens"], skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools in the system turn
    assert trained_text(tok, ds[0]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
        "</tool_call><|im_end|>Sunny and 22 degrees.<|im_end|>"
    )
    assert "temperature" in text and "temperature" not in trained_text(tok, ds[0])


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (
            tool_row(arguments='{"location": "Paris"'),
            r"message 1: tool call 0 \(get_weather\): arguments: not valid JSON \(",
        ),
        (
            tool_row(arguments='["Paris"]'),
            r"message 1: tool call 0 \(get_weather\): arguments must be a JSON object, got list",
        ),
        (
            tool_row(result_id="call00009"),
            r"message 2: tool message with no matching call \(tool_call_id 'call00009'; the "
            r"calls before it: 'call00001'\)",
        ),
        (
            {"messages": tool_row()["messages"][:1] + tool_row()["messages"][2:]},
            r"message 1: tool message with no matching call \(no assistant tool call before it\)",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "Weather in Paris?"},
                    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {'},
                    {"from": "observation", "value": "22"},
                    {"from": "gpt", "value": "22 degrees."},
                ]
            },
            r"message 1: function_call: not valid JSON \(",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
            r"message 1: missing 'content'",
        ),
    ],
)
def test_bad_tool_rows_are_one_error_naming_file_and_line(tmp_path, tokenizers, row, problem):
    good = tool_row()
    if "conversations" in row:
        good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    path = write_jsonl(tmp_path / "tools.jsonl", [good, row])
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match=r"tools.jsonl:2: row 1 \(0-based\), column .*" + problem):
        chat_dataset(tokenizers["qwen2_5"], source=path, cache_dir=cache)
    ds = chat_dataset(tokenizers["qwen2_5"], source=path, cache_dir=cache, skip_malformed=True)
    assert len(ds) == 1 and ds.num_skipped == 1


def test_named_formats_refuse_tool_rows(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "tools.jsonl", [tool_row()])
    with pytest.raises(DataError, match=r"tools.jsonl:1: .*need the model's own chat template"):
        chat_dataset(tokenizers["qwen2_5"], source=path, template="chatml")


def test_documents_reach_the_template(tmp_path, tokenizers):
    template = (
        "{% for d in documents %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = make_tokenizer_dir(tmp_path / "tok", SPECS["qwen2_5"])
    tok = load_tokenizer(folder, chat_template=template)
    row = {
        "documents": [{"title": "Paris", "text": "Sunny."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Sunny."},
        ],
    }
    path = write_jsonl(tmp_path / "docs.jsonl", [row])
    (item,) = chat_dataset(tok, source=path, cache_dir=str(tmp_path / "cache"))
    assert tok.decode(item["tokens"], skip_special_tokens=False).startswith(
        "<doc>Paris: Sunny.</doc><|im_start|>user"
    )
    assert trained_text(tok, item) == "Sunny.<|im_end|>"


def multi_turn(num_turns):
    messages = [{"role": "system", "content": "Be brief."}]
    for k in range(num_turns):
        messages += [
            {"role": "user", "content": f"Next number after {40 + k}:"},
            {"role": "assistant", "content": f"{41 + k}", "reasoning_content": f"{40 + k} + 1"},
        ]
    return {"messages": messages}


def test_phi3_5_conversation_is_one_sample_and_qwen3_is_split(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "chat.jsonl", [multi_turn(4)])
    (item,) = chat_dataset(tokenizers["phi3_5"], source=path, cache_dir=str(tmp_path / "c"))
    assert trained_text(tokenizers["phi3_5"], item) == "41<|end|>42<|end|>43<|end|>44<|end|>"
    qwen3 = chat_dataset(tokenizers["qwen3"], source=path, cache_dir=str(tmp_path / "c"))
    assert len(qwen3) == 4


def test_train_on_reasoning_setting(tmp_path, tokenizers):
    tok = tokenizers["qwen3"]
    path = write_jsonl(tmp_path / "chat.jsonl", [multi_turn(1)])
    cache = str(tmp_path / "c")
    (on,) = chat_dataset(tok, source=path, cache_dir=cache)
    (off,) = chat_dataset(tok, source=path, cache_dir=cache, train_on_reasoning=False)
    assert on["tokens"] == off["tokens"]
    assert trained_text(tok, on) == "<think>\n40 + 1\n</think>\n\n41<|im_end|>"
    assert trained_text(tok, off) == "<think>\n\n</think>\n\n41<|im_end|>"


def test_preview_states_the_layout_per_template():
    def first_lines(*overrides):
        out = io.StringIO()
        _data.preview("tiny/chat_lora", list(overrides), 1, as_json=False, out=out)
        return out.getvalue().splitlines()[1]

    assert first_lines().endswith(
        "a two-turn conversation is one sample: the whole render shows every assistant turn "
        "as the model generates it"
    )
    qwen3 = first_lines(f"tokenizer.chat_template={TEMPLATES / 'qwen3.jinja'}")
    assert qwen3.startswith(f"chat template {TEMPLATES / 'qwen3.jinja'}: a two-turn")
    assert "is 2 samples: the whole render shows assistant message 2 differently" in qwen3


# --- A tokenizer that does not fit the data ---------------------------------------------------


def word_tokenizer(tmp_path, words):
    """A word-level tokenizer knowing only ``words``: every other word is <unk>."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(tmp_path)


TEXT_ROWS = [{"text": "the cat sat on the mat"}, {"text": "a dog ran in the park today"}] * 3


def test_a_tokenizer_that_maps_the_data_to_unk_stops_the_build(tmp_path):
    tok = word_tokenizer(tmp_path, ["hello", "world"])
    path = write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)
    cache = str(tmp_path / "cache")
    with pytest.raises(
        DataError,
        match=r"text.jsonl: 100% of the content tokens of the first 6 samples \(39 of 39\) are "
        r"'<unk>': the tokenizer .*tokenizer.json does not fit the data .* A sample: "
        r"'<unk> <unk> <unk> <unk> <unk> <unk> </s>'. Set allow_unknown_tokens: true",
    ):
        text_dataset(tok, source=path, cache_dir=cache)
    assert len(text_dataset(tok, source=path, cache_dir=cache, allow_unknown_tokens=True)) == 6


def test_a_fitting_tokenizer_with_some_unknown_words_builds(tmp_path):
    # 3 of the 13 words of a pair of rows unknown (23%): under the 50% limit.
    known = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
    tok = word_tokenizer(tmp_path, known)
    path = write_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)
    assert len(text_dataset(tok, source=path, cache_dir=str(tmp_path / "cache"))) == 6
    # Half the words known tips it over: 7 of 13 unknown (54%).
    tok = word_tokenizer(tmp_path, known[:4])
    with pytest.raises(
        DataError, match=r"54% of the content tokens of the first 6 samples \(21 of 39\)"
    ):
        text_dataset(tok, source=path, cache_dir=str(tmp_path / "cache2"))
