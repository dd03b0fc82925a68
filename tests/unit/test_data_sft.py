"""SFT datasets: labels, masking, truncation, column maps, sources, malformed rows."""

import json

import pytest

from tunelab._paths import assets_dir
from tunelab.data import (
    IGNORE_INDEX,
    Message,
    chat_dataset,
    instruct_dataset,
    load_tokenizer,
    text_dataset,
    tokenize_messages,
)
from tunelab.errors import ConfigError, DataError

ALPACA = [
    {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red"},
    {"instruction": "What number comes after 41?", "input": "", "output": "42"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(assets_dir() / "tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def expected(tok, user, answer, template="instruct", masked=True):
    ids, mask = tokenize_messages(
        tok, [Message("user", user, masked=masked), Message("assistant", answer)], template
    )
    return ids, [IGNORE_INDEX if m else i for i, m in zip(ids, mask)]


def test_instruct_items_and_labels(tok, tmp_path):
    ds = instruct_dataset(tok, source=write_jsonl(tmp_path / "a.jsonl", ALPACA))
    assert len(ds) == 2 and ds.num_skipped == 0 and ds.num_truncated == 0 and not ds.packed
    tokens, labels = expected(tok, "Reverse the words.\n\n### Input:\nred cat", "cat red")
    assert ds[0] == {"tokens": tokens, "labels": labels}
    # Labels stay aligned with tokens: the trained tail is the answer then EOS.
    assert labels[-3:] == tokens[-3:] and tokens[-1] == tok.eos_id
    assert tok.decode(ds[1]["tokens"]).endswith("What number comes after 41?\n\n### Response:\n42")


def test_instruct_train_on_input_and_chat_template(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    ds = instruct_dataset(tok, source=path, template="llama3", train_on_input=True)
    assert ds[0] == dict(
        zip(
            ("tokens", "labels"),
            expected(tok, "Reverse the words.\n\nred cat", "cat red", "llama3", False),
        )
    )
    assert sum(label != IGNORE_INDEX for label in ds[0]["labels"]) > 4


def test_instruct_column_map_and_absent_input_column(tok, tmp_path):
    rows = [{"q": "What number comes after 41?", "a": "42"}]
    ds = instruct_dataset(
        tok, source="json", data_files=write_jsonl(tmp_path / "b.jsonl", rows),
        column_map={"instruction": "q", "output": "a"},
    )  # fmt: skip
    assert ds[0]["tokens"] == expected(tok, "What number comes after 41?", "42")[0]
    with pytest.raises(ConfigError, match=r"column_map key 'outptu' .*did you mean 'output'\?"):
        instruct_dataset(tok, source=str(tmp_path / "b.jsonl"), column_map={"outptu": "a"})


def test_truncation(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    full = instruct_dataset(tok, source=path)
    cut = instruct_dataset(tok, source=path, max_seq_len=10)
    assert cut.num_truncated == 2
    for i in range(2):
        assert cut[i]["tokens"] == full[i]["tokens"][:10]
        assert cut[i]["labels"] == full[i]["labels"][:10]
    # The tokenizer's max_seq_len is the default.
    short = load_tokenizer(assets_dir() / "tiny", max_seq_len=12)
    assert [len(item["tokens"]) for item in instruct_dataset(short, source=path)] == [12, 12]
    with pytest.raises(ConfigError, match="max_seq_len must be positive"):
        instruct_dataset(tok, source=path, max_seq_len=0)


def test_chat_openai_and_sharegpt(tok, tmp_path):
    openai = [{"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Next number after 41:"},
                            {"role": "assistant", "content": "42"}]}]  # fmt: skip
    sharegpt = [{"conversations": [{"from": "system", "value": "Be brief."},
                                   {"from": "human", "value": "Next number after 41:"},
                                   {"from": "gpt", "value": "42"}]}]  # fmt: skip
    a = chat_dataset(tok, source=write_jsonl(tmp_path / "o.jsonl", openai), template="chatml")
    b = chat_dataset(
        tok, source=write_jsonl(tmp_path / "s.jsonl", sharegpt), template="chatml",
        conversation_column="conversations", conversation_style="sharegpt",
    )  # fmt: skip
    assert a[0] == b[0]
    trained = [t for t, label in zip(a[0]["tokens"], a[0]["labels"]) if label != IGNORE_INDEX]
    assert tok.decode(trained, skip_special_tokens=False) == "42<|im_end|>"
    everything = chat_dataset(
        tok, source=str(tmp_path / "o.jsonl"), template="chatml", train_on_input=True
    )
    trained = [
        t
        for t, label in zip(everything[0]["tokens"], everything[0]["labels"])
        if label != IGNORE_INDEX
    ]
    assert tok.decode(trained, skip_special_tokens=False) == (
        "Be brief.<|im_end|>Next number after 41:<|im_end|>42<|im_end|>"
    )
    with pytest.raises(ConfigError, match="conversation_style must be"):
        chat_dataset(tok, source=str(tmp_path / "o.jsonl"), conversation_style="alpaca")


def test_sources_json_parquet_text_and_file_lists(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    (tmp_path / "a.json").write_text(json.dumps(ALPACA))
    pq.write_table(pa.Table.from_pylist(ALPACA), tmp_path / "a.parquet")
    reference = instruct_dataset(tok, source=jsonl)
    for source, files in [
        (str(tmp_path / "a.json"), None),
        (str(tmp_path / "a.parquet"), None),
        ("parquet", str(tmp_path / "a.parquet")),
        ("json", [jsonl]),
    ]:
        ds = instruct_dataset(tok, source=source, data_files=files)
        assert [ds[i] for i in range(2)] == [reference[i] for i in range(2)], source
    two = instruct_dataset(tok, source="json", data_files=[jsonl, str(tmp_path / "a.json")])
    assert len(two) == 4 and two[2] == reference[0]
    (tmp_path / "t.txt").write_text("red cat sun\nsort the letters\n")
    text = text_dataset(tok, source="text", data_files=str(tmp_path / "t.txt"))
    assert text[0]["tokens"] == tok.encode("red cat sun", add_eos=True)
    assert text[0]["labels"] == [IGNORE_INDEX, *text[0]["tokens"][1:]]


def test_missing_files_and_sources(tok, tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl"):
        instruct_dataset(tok, source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="source 'json' needs data_files"):
        instruct_dataset(tok, source="json")
    with pytest.raises(DataError, match=r"data source not found: \./missing"):
        instruct_dataset(tok, source="./missing")


def test_whole_column_missing_is_not_skippable(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "answer": "y"}])
    with pytest.raises(
        DataError, match=r"a\.jsonl: no column 'output' \(columns: instruction, answer\)"
    ):
        instruct_dataset(tok, source=path, skip_malformed=True)


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"instruction": "Count the words.", "input": "a b"}, r"row 1 \(0-based\), column 'output': missing value"),
        ({"instruction": "Count the words.", "output": 2}, r"row 1 \(0-based\), column 'output': expected a string, got int"),
        ({"instruction": "Count the words.", "output": "  "}, r"row 1 \(0-based\), column 'output': empty text"),
        ({"instruction": ["Count"], "output": "2"}, r"row 1 \(0-based\), column 'instruction': expected a string, got list"),
        ({"instruction": "Count the words.", "input": 3, "output": "2"}, r"row 1 \(0-based\), column 'input': expected a string, got int"),
    ],
)  # fmt: skip
def test_malformed_instruct_rows(tok, tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ALPACA[0], bad_row, ALPACA[1]])
    # JSON Lines errors name the line as file:line, then the 0-based row.
    with pytest.raises(DataError, match=r"bad\.jsonl:2: " + message):
        instruct_dataset(tok, source=path)
    ds = instruct_dataset(tok, source=path, skip_malformed=True)
    assert len(ds) == 2 and ds.num_skipped == 1


def test_malformed_row_names_its_own_file(tok, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", ALPACA)
    bad = write_jsonl(tmp_path / "second.jsonl", [ALPACA[0], ALPACA[1], {"instruction": "x"}])
    with pytest.raises(DataError, match=r"second\.jsonl:3: row 2 \(0-based\), column 'output'"):
        instruct_dataset(tok, source="json", data_files=[good, bad])


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ([], "empty conversation"),
        ("hello", "expected a list of messages, got str"),
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}], "empty assistant message"),
        ([{"role": "bot", "content": "hi"}], "message 0: unknown role 'bot'"),
        ([{"role": "user"}], "message 0: missing 'content'"),
        ([{"role": "user", "content": 5}], "message 0: content is int, not a string"),
    ],
)  # fmt: skip
def test_malformed_chat_rows(tok, tmp_path, conversation, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "42"}]}
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([good, {"messages": conversation}]))
    with pytest.raises(
        DataError, match=rf"chat\.json: row 1 \(0-based\), column 'messages': {message}"
    ):
        chat_dataset(tok, source=str(path))
    ds = chat_dataset(tok, source=str(path), skip_malformed=True)
    assert len(ds) == 1 and ds.num_skipped == 1


def test_every_row_malformed(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "x", "output": ""}] * 3)
    with pytest.raises(DataError, match=r"no usable rows \(3 malformed rows skipped\)"):
        instruct_dataset(tok, source=path, skip_malformed=True)


def test_broken_json_line_is_a_malformed_row(tok, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ALPACA[0]) + "\n{oops\n" + json.dumps(ALPACA[1]) + "\n")
    with pytest.raises(
        DataError,
        match=r"broken\.jsonl:2: row 1 \(0-based\), column '\(whole row\)': not valid JSON",
    ):
        instruct_dataset(tok, source=str(path))
    assert instruct_dataset(tok, source=str(path), skip_malformed=True).num_skipped == 1


def test_string_values_stay_strings_when_a_column_mixes_types(tok, tmp_path):
    # datasets' Json feature would decode the string "42" of row 2 to the int 42.
    rows = [
        ALPACA[0],
        {"instruction": "x", "output": 7},
        {"instruction": "Next after 41?", "output": "42"},
    ]
    ds = instruct_dataset(tok, source=write_jsonl(tmp_path / "m.jsonl", rows), skip_malformed=True)
    assert ds.num_skipped == 1 and tok.decode(ds[1]["tokens"]).endswith("42")
