"""Chat templates from the tokenizer: loading, sandboxed rendering, and labels on assistant turns.

The ids are compared with transformers in tests/interop/test_chat_template_hf.py; here each
template's trained tokens are checked against hand-written text.
"""

import json

import pytest

from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tunelab._paths import assets_dir
from tunelab.data import (
    ChatTemplate,
    ChatTemplateError,
    Message,
    apply_chat_template,
    chat_dataset,
    get_template,
    instruct_dataset,
    load_tokenizer,
    preference_dataset,
    tokenize_conversation,
    tokenize_messages,
)
from tunelab.errors import ConfigError, DataError

TINY = assets_dir() / "tiny"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Sort the letters: d a c"},
    {"role": "assistant", "content": "a c d"},
    {"role": "user", "content": "Next number after 41:"},
    {"role": "assistant", "content": "42"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Template name -> tunelab tokenizer whose config carries that template."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {
        name: load_tokenizer(make_tokenizer_dir(root / name, spec)) for name, spec in SPECS.items()
    }


def trained_runs(tok, ids, mask):
    """The trained tokens, decoded run by run (each run of consecutive trained tokens)."""
    runs, run = [], []
    for token, masked in zip(ids, mask):
        if not masked:
            run.append(token)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    if run:
        runs.append(tok.decode(run, skip_special_tokens=False))
    return runs


def text_template(text, **special_tokens):
    return ChatTemplate(text, source="test.jinja", special_tokens=special_tokens)


# --- Rendering: what transformers gives a template -----------------------------------------------


def test_render_environment_matches_transformers_helpers():
    template = text_template(
        "{{ bos_token }}|{{ {'b': 'é', 'a': [1, 2]} | tojson }}|{{ {'k': 1} | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
        "{% endfor %}|{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|"
        "{{ strftime_now('%Y') | length }}|{{ extra }}",
        bos_token="<s>",
    )
    text = template.render(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
        add_generation_prompt=True,
        template_kwargs={"extra": "x"},
    )
    # tojson keeps non-ASCII text and key order; loopcontrols gives break.
    assert text == '<s>|{"b": "é", "a": [1, 2]}|{\n  "k": 1\n}|one|True|True|True|4|x'


def test_trim_and_lstrip_blocks_as_transformers():
    template = text_template("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}")
    assert template.render([{"role": "user", "content": "a"}]) == "    a\n"
    dashed = text_template("{%- for m in messages %}\n    {{- m.content }}\n{%- endfor %}")
    assert dashed.render([{"role": "user", "content": "a"}]) == "a"


def test_template_kwargs_win_over_special_tokens_but_not_over_messages():
    template = text_template("{{ bos_token }}{{ messages | length }}", bos_token="<s>")
    assert (
        template.render([{"role": "user", "content": "a"}], template_kwargs={"bos_token": "B"})
        == "B1"
    )
    with pytest.raises(ConfigError, match="template_kwargs may not set messages"):
        template.render([], template_kwargs={"messages": []})


def test_messages_are_normalized_like_transformers():
    template = text_template(
        "{% for m in messages %}{{ m.keys() | list | sort | join(',') }}:{{ m.reasoning_content }}"
        "/{{ m.thinking }};{% endfor %}"
    )
    text = template.render(
        [
            {"role": "assistant", "content": "a", "tool_calls": None, "reasoning": "r"},
            Message("user", "b", masked=True),
        ]
    )
    assert text == "content,reasoning,reasoning_content,role,thinking:r/r;content,role:/;"


def test_raise_exception_is_one_data_error_naming_the_template():
    template = text_template("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(
        ChatTemplateError, match=r"^chat template test.jinja \(line 1\): roles must alternate$"
    ):
        template.render([{"role": "user", "content": "a"}])


def test_a_failing_expression_names_the_template_line():
    template = text_template("ok\n{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match=r"test.jinja \(line 2\): .*"):
        template.render([{"role": "user", "content": "a"}])


def test_syntax_error_names_source_and_line():
    template = text_template("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(DataError, match=r"^chat template test.jinja: line 2: ") as info:
        template.check()
    assert not isinstance(info.value, ChatTemplateError)  # no row could be rendered


@pytest.mark.parametrize(
    "text",
    [
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{% set ns = namespace(_x=1) %}",
        "{{ messages.append(1) }}",  # immutable sandbox: no mutating methods
    ],
)
def test_sandbox_refuses_python_internals(text):
    with pytest.raises(ChatTemplateError):
        text_template(text).render([{"role": "user", "content": "a"}])


def test_sandbox_hides_unsafe_attributes():
    assert text_template("{{ messages.__class__ }}").render([]) == ""


def test_generation_blocks_report_their_spans():
    template = text_template(
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}!{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text, spans = template.render_with_spans(messages)
    assert template.has_generation_blocks and text == "<user>hi<assistant>yo!"
    assert [text[a:b] for a, b in spans] == ["yo!"]
    assert template.render(messages) == text


# --- Finding the tokenizer's template ---------------------------------------------------------------


def test_template_from_config_string_file_and_named_list(tmp_path):
    spec = SPECS["qwen2_5"]
    inline = load_tokenizer(make_tokenizer_dir(tmp_path / "inline", spec))
    assert inline.chat_template.text == spec.template
    assert inline.chat_template.source.endswith("tokenizer_config.json (chat_template)")
    assert inline.chat_template.special_tokens == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }

    as_file = make_tokenizer_dir(tmp_path / "file", spec, chat_template="file")
    assert load_tokenizer(as_file).chat_template.source == str(as_file / "chat_template.jinja")

    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    folder = make_tokenizer_dir(tmp_path / "named", spec, chat_template=named)
    assert load_tokenizer(folder).chat_template.text == "D"
    assert load_tokenizer(folder, chat_template="tool_use").chat_template.text == "T"


def test_jinja_file_wins_over_the_config(tmp_path):
    folder = make_tokenizer_dir(tmp_path, SPECS["qwen2_5"])
    (folder / "chat_template.jinja").write_text("from the file")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("rag")
    assert load_tokenizer(folder).chat_template.text == "from the file"
    assert load_tokenizer(folder, chat_template="rag").chat_template.text == "rag"


def test_chat_template_override_is_a_file_or_text(tmp_path):
    file = tmp_path / "mine.jinja"
    file.write_text("{{ 'mine' }}")
    assert load_tokenizer(TINY, chat_template=str(file)).chat_template.source == str(file)
    tok = load_tokenizer(TINY, chat_template="{{ bos_token }}x")
    assert tok.chat_template.render([{"role": "user", "content": "a"}]) == "<|begin_of_text|>x"
    with pytest.raises(ConfigError, match=r"chat_template 'nope.jinja' is not a template name"):
        load_tokenizer(TINY, chat_template="nope.jinja")


def test_auto_without_a_template_names_the_formats(tmp_path):
    tok = load_tokenizer(make_tokenizer_dir(tmp_path, SPECS["qwen2_5"], chat_template=None))
    message = r"has no chat template .*name a format: alpaca, chatml, instruct, llama3"
    with pytest.raises(ConfigError, match=message):
        get_template("auto", tok)
    with pytest.raises(ConfigError, match=message):
        chat_dataset(tok, source=str(TINY / "chat.jsonl"))


def test_named_templates_without_default(tmp_path):
    named = [{"name": "tool_use", "template": "T"}]
    tok = load_tokenizer(make_tokenizer_dir(tmp_path, SPECS["qwen2_5"], chat_template=named))
    with pytest.raises(
        ConfigError, match=r"named chat templates \(tool_use\) but none named 'default'"
    ):
        get_template("auto", tok)


def test_malformed_chat_template_key(tmp_path):
    folder = make_tokenizer_dir(tmp_path, SPECS["qwen2_5"], chat_template=[{"name": 1}])
    with pytest.raises(DataError, match="chat_template must be a string or a list"):
        load_tokenizer(folder)


# --- Labels: the assistant turns as the template renders them, and nothing else ---------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3_2", [["a c d<|eot_id|>", "42<|eot_id|>"]]),
        ("qwen2_5", [["a c d<|im_end|>", "42<|im_end|>"]]),  # not the newline after <|im_end|>
        ("generation", [["a c d<|im_end|>", "42<|im_end|>"]]),
        ("system_merged", [[" a c d </s>", " 42 </s>"]]),  # the reply follows " [/INST]"
        # Mistral writes the system prompt into the last user turn only: one sample per turn.
        ("mistral_nemo", [["a c d</s>"], ["42</s>"]]),
        # The last turn's empty <think> block is generated; earlier turns are rendered without.
        (
            "reasoning",
            [["<think>\n\n</think>\n\na c d<|im_end|>"], ["<think>\n\n</think>\n\n42<|im_end|>"]],
        ),
    ],
)
def test_trained_tokens_are_the_assistant_turns(tokenizers, name, expected):
    tok = tokenizers[name]
    samples = tokenize_conversation(
        tok, CONVERSATION, template_kwargs={"date_string": "26 Jul 2024"}
    )
    assert [trained_runs(tok, ids, mask) for ids, mask in samples] == expected
    assert all(mask[0] for _, mask in samples)  # a document never starts with a trained token


def test_no_system_template(tokenizers):
    tok = tokenizers["no_system"]
    ((ids, mask),) = tokenize_conversation(tok, CONVERSATION[1:])
    assert trained_runs(tok, ids, mask) == ["a c d<end_of_turn>", "42<end_of_turn>"]
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tokenize_conversation(tok, CONVERSATION)


def test_single_sample_equals_the_whole_render(tokenizers):
    tok = tokenizers["qwen2_5"]
    ((ids, _),) = tokenize_conversation(tok, CONVERSATION)
    assert ids == apply_chat_template(tok, CONVERSATION)


def test_mistral_turn_samples_are_prompt_plus_reply(tokenizers):
    # Each sample is exactly what the model is served for that turn, then its reply.
    tok = tokenizers["mistral_nemo"]
    first, second = tokenize_conversation(tok, CONVERSATION)
    assert tok.decode(first[0], skip_special_tokens=False) == (
        "<s>[INST]Be brief.\n\nSort the letters: d a c[/INST]a c d</s>"
    )
    for (ids, _), upto in ((first, 2), (second, 4)):
        prompt = apply_chat_template(tok, CONVERSATION[:upto], add_generation_prompt=True)
        assert ids[: len(prompt)] == prompt
    # The whole conversation's render has no system prompt at all (it ends with the assistant);
    # the second sample has it where the model is served it, in the last user turn.
    assert "Be brief" not in tok.decode(apply_chat_template(tok, CONVERSATION))
    assert tok.decode(second[0], skip_special_tokens=False) == (
        "<s>[INST]Sort the letters: d a c[/INST]a c d</s>"
        "[INST]Be brief.\n\nNext number after 41:[/INST]42</s>"
    )


def test_reasoning_template_trains_each_turn_on_its_own_render(tokenizers):
    tok = tokenizers["reasoning"]
    conversation = [
        {"role": "user", "content": "Sort the letters: d a c"},
        {"role": "assistant", "content": "<think>\nsorting\n</think>\n\na c d"},
        {"role": "user", "content": "Next number after 41:"},
        {"role": "assistant", "content": "<think>\ncounting\n</think>\n\n42"},
    ]
    first, second = tokenize_conversation(tok, conversation)
    assert trained_runs(tok, *first) == ["<think>\nsorting\n</think>\n\na c d<|im_end|>"]
    assert trained_runs(tok, *second) == ["<think>\ncounting\n</think>\n\n42<|im_end|>"]
    # In the second sample the first turn appears as served later: without its reasoning.
    assert "sorting" not in tok.decode(second[0], skip_special_tokens=False)
    # With thinking off, the generation prompt prefills the empty block, so it is not trained.
    samples = tokenize_conversation(
        tok,
        [{**m, "content": m["content"].split("\n\n")[-1]} for m in conversation],
        template_kwargs={"enable_thinking": False},
    )
    assert [trained_runs(tok, *sample) for sample in samples] == [
        ["a c d<|im_end|>"],
        ["42<|im_end|>"],
    ]


def test_train_on_input_trains_everything_but_the_first_token(tokenizers):
    tok = tokenizers["llama3_2"]
    ((ids, mask),) = tokenize_conversation(tok, CONVERSATION, train_on_input=True)
    assert mask == [True] + [False] * (len(ids) - 1)


def test_trained_turns_selects_assistant_messages(tokenizers):
    tok = tokenizers["qwen2_5"]
    ((ids, mask),) = tokenize_conversation(tok, CONVERSATION, trained_turns=[4])
    assert trained_runs(tok, ids, mask) == ["42<|im_end|>"]


def test_bad_role_order_raises(tokenizers):
    conversation = [CONVERSATION[1], CONVERSATION[1], CONVERSATION[2]]
    for name in ("mistral_nemo", "system_merged", "no_system"):
        with pytest.raises(ChatTemplateError, match="roles must alternate"):
            tokenize_conversation(tokenizers[name], conversation)


def test_tokenize_messages_with_auto_on_tiny_equals_the_llama3_format():
    # The tiny tokenizer's own template is the llama3 format: same ids and masks.
    tok = load_tokenizer(TINY)
    messages = [
        Message("system", "Be brief.", masked=True),
        Message("user", "Next number after 41:", masked=True),
        Message("assistant", "42"),
    ]
    assert tokenize_messages(tok, messages, "auto") == tokenize_messages(tok, messages, "llama3")
    prompt = messages[:2]
    assert tokenize_messages(tok, prompt, "auto", add_generation_prompt=True) == tokenize_messages(
        tok, prompt, "llama3", add_generation_prompt=True
    )


# --- Datasets -----------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_chat_dataset_defaults_to_auto():
    tok = load_tokenizer(TINY)
    auto = chat_dataset(tok, source=str(TINY / "chat.jsonl"))
    named = chat_dataset(tok, source=str(TINY / "chat.jsonl"), template="llama3")
    assert len(auto) == len(named) == 300
    assert all(auto[i] == named[i] for i in range(len(auto)))


def test_template_error_names_file_row_and_template(tmp_path, tokenizers):
    rows = [
        {"messages": CONVERSATION[1:3]},
        {"messages": [CONVERSATION[1], CONVERSATION[1], CONVERSATION[2]]},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = tokenizers["mistral_nemo"]
    with pytest.raises(
        DataError,
        match=r"chat.jsonl:2: row 1 \(0-based\), column 'messages': chat template "
        r".*tokenizer_config.json \(chat_template\) \(line \d+\): After the optional system "
        r"message, conversation roles must alternate",
    ):
        chat_dataset(tok, source=path)
    ds = chat_dataset(tok, source=path, skip_malformed=True)
    assert len(ds) == 1 and ds.num_skipped == 1


def test_per_turn_samples_in_a_dataset(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    assert len(chat_dataset(tokenizers["mistral_nemo"], source=path)) == 2
    assert len(chat_dataset(tokenizers["qwen2_5"], source=path)) == 1


def test_template_kwargs_reach_the_template(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    tok = tokenizers["llama3_2"]
    ds = chat_dataset(tok, source=path, template_kwargs={"date_string": "01 Jan 2000"})
    assert "Today Date: 01 Jan 2000" in tok.decode(ds[0]["tokens"])
    with pytest.raises(
        ConfigError, match="template_kwargs are variables of the tokenizer's chat template"
    ):
        chat_dataset(tok, source=path, template="chatml", template_kwargs={"x": 1})


def test_instruct_dataset_with_auto(tmp_path, tokenizers):
    path = write_jsonl(
        tmp_path / "a.jsonl", [{"instruction": "Count.", "input": "a b", "output": "2"}]
    )
    tok = tokenizers["qwen2_5"]
    ds = instruct_dataset(tok, source=path, template="auto")
    ids, labels = ds[0]["tokens"], ds[0]["labels"]
    assert tok.decode([t for t in labels if t != -100], skip_special_tokens=False) == "2<|im_end|>"
    assert "<|im_start|>user\nCount.\n\na b<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_preference_dataset_with_auto_trains_only_the_answer(tmp_path, tokenizers):
    rows = [
        {
            "prompt": [CONVERSATION[1], CONVERSATION[2], CONVERSATION[3]],
            "chosen": "42",
            "rejected": "43",
        }
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    tok = tokenizers["qwen2_5"]
    item = preference_dataset(tok, source=path)[0]
    for side, answer in (("chosen", "42"), ("rejected", "43")):
        labels = [t for t in item[f"{side}_labels"] if t != -100]
        assert tok.decode(labels, skip_special_tokens=False) == f"{answer}<|im_end|>"


def test_alpaca_template_has_the_preamble():
    tok = load_tokenizer(TINY)
    template = get_template("alpaca")
    for given, preamble in (
        ("", "Below is an instruction that describes a task. Write"),
        ("red cat", "Below is an instruction that describes a task, paired with an input"),
    ):
        user = template.join_instruction("Reverse the words.", given)
        ids, mask = tokenize_messages(
            tok, [Message("user", user, masked=True), Message("assistant", "cat red")], template
        )
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith(f"<|begin_of_text|>{preamble}")
        assert "### Instruction:\nReverse the words." in text
        assert ("### Input:\nred cat\n\n" in text) == bool(given)
        assert text.endswith("### Response:\ncat red<|end_of_text|>")
        trained = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
        assert trained == "cat red<|end_of_text|>"
