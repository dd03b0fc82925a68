"""Reading rows (JSON as written, broken lines, Arrow, CSV), layouts, and the tokenized cache."""

import json
import pickle

import pytest

from tunelab._paths import assets_dir
from tunelab.data import (
    cache,
    chat_dataset,
    instruct_dataset,
    load_tokenizer,
    preference_dataset,
)
from tunelab.data.tokenizer import Tokenizer
from tunelab.errors import ConfigError, DataError

TINY = assets_dir() / "tiny"
ALPACA = [
    {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red"},
    {"instruction": "What number comes after 41?", "input": "", "output": "42"},
]
OPENAI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Next number after 41:"},
    {"role": "assistant", "content": "42"},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Next number after 41:"},
    {"from": "gpt", "value": "42"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def items(dataset):
    return [dataset[i] for i in range(len(dataset))]


# -- reading rows ------------------------------------------------------------------------------


def test_non_utf8_line_is_a_malformed_row_named_by_file_and_line(tok, tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(ALPACA[0]).encode()
    bad = json.dumps({**ALPACA[1], "output": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    path.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    with pytest.raises(
        DataError,
        match=r"latin1\.jsonl:2: row 1 \(0-based\), column '\(whole row\)': not UTF-8 text "
        r"\(byte 0xe9 at column \d+\)",
    ):
        instruct_dataset(tok, source=str(path))
    ds = instruct_dataset(tok, source=str(path), skip_malformed=True)
    assert len(ds) == 2 and ds.num_skipped == 1


def test_byte_order_mark_and_line_separators_inside_strings(tok, tmp_path):
    # U+2028 is valid unescaped inside a JSON string; it does not end a JSON Lines row.
    row = {**ALPACA[0], "input": "red\u2028cat"}
    path = tmp_path / "bom.jsonl"
    text = json.dumps(row, ensure_ascii=False) + "\n" + json.dumps(ALPACA[1]) + "\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    ds = instruct_dataset(tok, source=str(path))
    assert len(ds) == 2 and ds.num_skipped == 0
    assert "red\u2028cat" in tok.decode(ds[0]["tokens"])


def test_json_documents_and_field(tok, tmp_path):
    reference = items(instruct_dataset(tok, source=write_jsonl(tmp_path / "a.jsonl", ALPACA)))
    (tmp_path / "array.json").write_text(json.dumps(ALPACA, indent=2))
    (tmp_path / "field.json").write_text(json.dumps({"rows": ALPACA, "meta": 1}, indent=2))
    assert items(instruct_dataset(tok, source=str(tmp_path / "array.json"))) == reference
    field = instruct_dataset(tok, source=str(tmp_path / "field.json"), field="rows")
    assert items(field) == reference
    with pytest.raises(DataError, match=r"field\.json: no top-level field 'data'"):
        instruct_dataset(tok, source=str(tmp_path / "field.json"), field="data")


def test_arrow_and_csv_files(tok, tmp_path):
    import pyarrow as pa

    reference = items(instruct_dataset(tok, source=write_jsonl(tmp_path / "a.jsonl", ALPACA)))
    table = pa.Table.from_pylist(ALPACA)
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    assert items(instruct_dataset(tok, source=str(tmp_path / "a.arrow"))) == reference
    (tmp_path / "a.csv").write_text(
        "instruction,input,output\n"
        '"Reverse the words.","red cat","cat red"\n'
        '"What number comes after 41?",,"42"\n'
    )
    assert items(instruct_dataset(tok, source=str(tmp_path / "a.csv"))) == reference
    (tmp_path / "bad.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"bad\.arrow: cannot read as an Arrow file"):
        instruct_dataset(tok, source=str(tmp_path / "bad.arrow"))


def test_a_file_of_broken_lines_reports_its_first_line(tok, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text("{oops\n[1, 2\n")
    with pytest.raises(DataError, match=r"broken\.jsonl:1: row 0 \(0-based\).*not valid JSON"):
        chat_dataset(tok, source=str(path))
    with pytest.raises(DataError, match=r"no usable rows \(2 malformed rows skipped\)"):
        chat_dataset(tok, source=str(path), skip_malformed=True)


# -- layouts -----------------------------------------------------------------------------------


def test_chat_layout_found_from_the_columns(tok, tmp_path):
    openai = chat_dataset(tok, source=write_jsonl(tmp_path / "o.jsonl", [{"messages": OPENAI}]))
    sharegpt = chat_dataset(
        tok, source=write_jsonl(tmp_path / "s.jsonl", [{"conversations": SHAREGPT}])
    )
    # ShareGPT messages under a "messages" column: the style is found per conversation.
    mixed = chat_dataset(
        tok,
        source=write_jsonl(tmp_path / "m.jsonl", [{"messages": SHAREGPT}, {"messages": OPENAI}]),
    )
    assert items(sharegpt) == items(openai) and items(mixed) == items(openai) * 2
    explicit = chat_dataset(
        tok, source=str(tmp_path / "s.jsonl"), conversation_column="conversations",
        conversation_style="sharegpt",
    )  # fmt: skip
    assert items(explicit) == items(openai)
    with pytest.raises(DataError, match=r"message 0: missing 'role'"):
        chat_dataset(tok, source=str(tmp_path / "m.jsonl"), conversation_style="openai")
    none = write_jsonl(tmp_path / "n.jsonl", [{"dialog": OPENAI}])
    with pytest.raises(
        DataError, match=r"n\.jsonl: no conversation column: expected 'messages' \(OpenAI\) or "
    ):
        chat_dataset(tok, source=none)
    assert items(chat_dataset(tok, source=none, conversation_column="dialog")) == items(openai)


def test_preference_shared_prompt_prefix(tok, tmp_path):
    prompt = OPENAI[:2]
    plain = {"prompt": prompt, "chosen": "42", "rejected": "43"}
    whole = {
        "chosen": [*prompt, {"role": "assistant", "content": "42"}],
        "rejected": [*prompt, {"role": "assistant", "content": "43"}],
    }
    reference = items(preference_dataset(tok, source=write_jsonl(tmp_path / "p.jsonl", [plain])))
    # Without a prompt column: the prompt is what chosen and rejected start with.
    shared = preference_dataset(tok, source=write_jsonl(tmp_path / "w.jsonl", [whole]))
    assert items(shared) == reference
    # UltraFeedback: a prompt column and answers that repeat it.
    repeated = {"prompt": prompt, **whole}
    ultra = preference_dataset(tok, source=write_jsonl(tmp_path / "u.jsonl", [repeated]))
    assert items(ultra) == reference
    different = {
        "chosen": whole["chosen"],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "43"}],
    }
    path = write_jsonl(tmp_path / "d.jsonl", [whole, different])
    with pytest.raises(DataError, match=r"d\.jsonl:2: row 1 \(0-based\), column 'chosen': "):
        preference_dataset(tok, source=path)
    assert preference_dataset(tok, source=path, skip_malformed=True).num_skipped == 1
    # A prompt column named in column_map must exist.
    with pytest.raises(DataError, match=r"no column 'question'"):
        preference_dataset(tok, source=path, column_map={"prompt": "question"})


# -- the tokenized cache -------------------------------------------------------------------------


class Counter:
    """Counts the rows the tokenizer encodes in this process."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("encode", "encode_with_offsets"):
            original = getattr(Tokenizer, name)

            def counted(self_, *args, _original=original, **kwargs):
                self.calls += 1
                return _original(self_, *args, **kwargs)

            monkeypatch.setattr(Tokenizer, name, counted)


def test_cache_is_reused_unless_something_that_changes_the_samples_changes(
    tok, tmp_path, monkeypatch
):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    cache = tmp_path / "cache"
    first = instruct_dataset(tok, source=path, cache_dir=str(cache), max_seq_len=64)
    counter = Counter(monkeypatch)
    # Opening options: packing and skipping are decided on the cached table.
    again = instruct_dataset(
        tok, source=path, cache_dir=str(cache), max_seq_len=64, skip_malformed=True
    )
    packed = instruct_dataset(tok, source=path, cache_dir=str(cache), max_seq_len=64, packed=True)
    assert counter.calls == 0 and items(again) == items(first) and len(packed) == 1
    assert len(list(cache.iterdir())) == 1
    # Each of these changes the samples, so each tokenizes again.
    changes = [
        dict(max_seq_len=10),
        dict(template="alpaca"),
        dict(train_on_input=True),
        dict(column_map={"output": "input", "input": "output"}),
    ]
    for change in changes:
        instruct_dataset(tok, source=path, cache_dir=str(cache), skip_malformed=True, **change)
    other_template = load_tokenizer(TINY, chat_template="{{ messages[0]['content'] }}")
    instruct_dataset(other_template, source=path, cache_dir=str(cache), template="auto")
    write_jsonl(tmp_path / "a.jsonl", ALPACA[:1])  # the file changes
    assert len(instruct_dataset(tok, source=path, cache_dir=str(cache))) == 1
    assert len(list(cache.iterdir())) == 1 + len(changes) + 2
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no leftovers


def test_worker_processes_give_the_same_samples(tok, tmp_path, monkeypatch):
    rows = [{**ALPACA[i % 2], "input": f"red cat {i}"} for i in range(60)]
    rows[7] = {"instruction": "x"}
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    one = instruct_dataset(tok, source=path, num_proc=1, cache_dir=str(tmp_path / "one"),
                           skip_malformed=True)  # fmt: skip
    monkeypatch.setattr(cache, "MIN_ROWS_PER_WORKER", 10)
    two = instruct_dataset(tok, source=path, num_proc=3, cache_dir=str(tmp_path / "two"),
                           skip_malformed=True)  # fmt: skip
    assert items(one) == items(two) and one.num_skipped == two.num_skipped == 1
    folder = next((tmp_path / "two").iterdir())
    assert len(list(folder.glob("source-0_*_of_00003.arrow"))) == 3
    with pytest.raises(ConfigError, match="num_proc must be at least 1"):
        instruct_dataset(tok, source=path, num_proc=0)


def test_items_are_read_from_the_table_not_held(tok):
    ds = instruct_dataset(tok, source=str(TINY / "sft.jsonl"), max_seq_len=128)
    # A memory-mapped table pickles as its file path: the dataset holds no token lists.
    assert len(ds) == 1600 and len(pickle.dumps(ds)) < 20_000
    assert ds[-1] == ds[1599]
    with pytest.raises(IndexError):
        ds[1600]


def test_publish_keeps_the_first_finished_table(tmp_path):
    target = tmp_path / "key"
    target.mkdir()
    (target / cache._MANIFEST).write_text("{}")
    work = tmp_path / ".key.tmp"
    work.mkdir()
    cache._publish(work, target)
    assert (target / cache._MANIFEST).read_text() == "{}"
    # An unfinished leftover (no manifest) is replaced.
    (target / cache._MANIFEST).unlink()
    (work / cache._MANIFEST).write_text('{"files": []}')
    cache._publish(work, target)
    assert json.loads((target / cache._MANIFEST).read_text()) == {"files": []}


@pytest.mark.parametrize(
    ("broken", "where"),
    [
        # The row stops before its closing brace: the fault is at its end, not column 1.
        ('{"instruction": "a", "output": "b"', r"at the end of the row \(column 35\): a closing "),
        ('{"instruction": "a", "output": "b', r"at the end of the row \(column 34\)"),
        ('{"instruction": "a" "output": "b"}', r"Expecting ',' delimiter at column 21\)"),
        ('{"instruction": "a"}}', r"Extra data at column 21\)"),
    ],
)
def test_a_broken_json_row_names_the_column_of_its_fault(tok, tmp_path, broken, where):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ALPACA[0]) + "\n" + broken + "\n" + json.dumps(ALPACA[1]) + "\n")
    with pytest.raises(DataError, match=r"broken\.jsonl:2: .*not valid JSON \(.*" + where):
        instruct_dataset(tok, source=str(path))
