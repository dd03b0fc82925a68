"""Chat templates render and tokenize exactly as transformers' apply_chat_template.

Every template in tests/chat_templates/ (the real Llama 3.2, Qwen 2.5 and Mistral Nemo ones and
templates of other shapes) runs on a tokenizer folder built offline, read by both tunelab and
``AutoTokenizer``; the text, the ids, and (for ``{% generation %}`` templates) the assistant
mask must be equal.
"""

import datetime as real_datetime
import shutil
from pathlib import Path

import pytest

from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tunelab._paths import assets_dir
from tunelab.data import _jinja_env, apply_chat_template, load_tokenizer, tokenize_conversation

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [
    {"role": "user", "content": "Sort the letters: d a c"},
    {"role": "assistant", "content": "a c d"},
    {"role": "user", "content": "  Next number after 41:\n"},
    {"role": "assistant", "content": "42 "},
]
UNICODE = [
    {"role": "user", "content": "unicode: héllo ☃ 日本語 🙂, and a literal <|im_end|> </s> [INST]"},
    {"role": "assistant", "content": '{"name": "x"}\n\n\ttabs'},
]
CONVERSATIONS = {
    "system": [SYSTEM, *TURNS],
    "no_system": TURNS,
    "one_turn": TURNS[:2],
    "unicode": UNICODE,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "A city, e.g. Paris"}},
            "required": ["location"],
        },
    },
}
KWARGS = {"date_string": "26 Jul 2024"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_templates_hf")
    return {name: make_tokenizer_dir(root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def pairs(folders):
    """Template name -> (tunelab tokenizer, transformers tokenizer) on the same folder."""
    return {
        name: (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
        for name, folder in folders.items()
    }


def hf_ids(hf_tok, messages, **kwargs):
    return list(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def check_same(pair, messages, **kwargs):
    tok, hf_tok = pair
    text = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    options = {k: kwargs.pop(k) for k in ("add_generation_prompt", "tools") if k in kwargs}
    ours_text = tok.chat_template.render(messages, template_kwargs=kwargs, **options)
    assert ours_text == text
    ours = apply_chat_template(tok, messages, template_kwargs=kwargs, **options)
    assert ours == hf_ids(hf_tok, messages, **options, **kwargs)
    return ours


# The no-system template refuses a system message (tested in the unit tests).
CASES = [
    (name, conversation)
    for name in sorted(SPECS)
    for conversation in sorted(CONVERSATIONS)
    if not (name == "no_system" and CONVERSATIONS[conversation][0]["role"] == "system")
]


@pytest.mark.parametrize(("name", "conversation"), CASES)
def test_ids_match_apply_chat_template(pairs, name, conversation):
    messages = CONVERSATIONS[conversation]
    ids = check_same(pairs[name], messages, **KWARGS)
    # What the model is asked to continue: everything up to the last reply, plus the header.
    check_same(pairs[name], messages[:-1], add_generation_prompt=True, **KWARGS)
    # Training ids are the served ids whenever the conversation is one sample.
    samples = tokenize_conversation(pairs[name][0], messages, template_kwargs=KWARGS)
    if len(samples) == 1:
        assert samples[0][0] == ids


def test_generation_mask_matches_return_assistant_tokens_mask(pairs):
    tok, hf_tok = pairs["generation"]
    for messages in CONVERSATIONS.values():
        out = hf_tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ((ids, mask),) = tokenize_conversation(tok, messages)
        assert ids == list(out["input_ids"])
        assert [int(not masked) for masked in mask] == list(out["assistant_masks"])
        assert any(out["assistant_masks"])


def test_qwen_tools_and_tool_calls(pairs):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "It is sunny and 22 degrees."},
    ]
    check_same(pairs["qwen2_5"], messages, tools=[WEATHER_TOOL])
    check_same(pairs["qwen2_5"], messages[:1], tools=[WEATHER_TOOL], add_generation_prompt=True)


def test_llama_tools_in_user_message_and_in_system(pairs):
    messages = [SYSTEM, {"role": "user", "content": "What is the weather in Paris?"}]
    check_same(
        pairs["llama3_2"], messages, tools=[WEATHER_TOOL], add_generation_prompt=True, **KWARGS
    )
    check_same(
        pairs["llama3_2"],
        messages,
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
        tools_in_user_message=False,
        **KWARGS,
    )


def test_mistral_tools(pairs):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "abcdef123",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "abcdef123", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "Sunny, 22 degrees."},
    ]
    check_same(pairs["mistral_nemo"], messages, tools=[WEATHER_TOOL])


def test_llama_date_from_strftime_now(pairs, monkeypatch):
    # Without date_string the Llama template writes today's date: pin the clock on both sides.
    class Frozen(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 3, 14, 12, 0, 0)

    monkeypatch.setattr(_jinja_env, "datetime", Frozen)
    monkeypatch.setattr(transformers.utils.chat_template_utils, "datetime", Frozen)
    ids = check_same(pairs["llama3_2"], TURNS[:1], add_generation_prompt=True)
    assert "Today Date: 14 Mar 2025" in pairs["llama3_2"][0].decode(ids)


@pytest.mark.parametrize("layout", ["file", "named"])
def test_template_found_where_transformers_finds_it(tmp_path, layout):
    spec = SPECS["qwen2_5"]
    template = (
        "file"
        if layout == "file"
        else [
            {"name": "default", "template": spec.template},
            {"name": "tool_use", "template": "{{ 'tools!' }}"},
        ]
    )
    folder = make_tokenizer_dir(tmp_path, spec, chat_template=template)
    pair = (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
    check_same(pair, CONVERSATIONS["system"])


def test_whitespace_control_matches(folders):
    # Indented block tags and newlines after them: trim_blocks and lstrip_blocks decide the text.
    template = (
        "{% for message in messages %}\n"
        "    {% if message.role == 'user' %}\n"
        "  <|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "    {% else %}\n"
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    tok = load_tokenizer(folders["qwen2_5"], chat_template=template)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folders["qwen2_5"])
    text = hf_tok.apply_chat_template(TURNS, chat_template=template, tokenize=False)
    assert tok.chat_template.render(TURNS) == text
    assert apply_chat_template(tok, TURNS) == hf_ids(hf_tok, TURNS, chat_template=template)


def test_export_files_make_transformers_serve_the_overridden_template(tmp_path):
    # What an export does: copy the base tokenizer files, then write Tokenizer.extra_files().
    tiny = assets_dir() / "tiny"
    qwen = Path(__file__).resolve().parents[1] / "chat_templates" / "qwen2_5_instruct.jinja"
    trained = load_tokenizer(tiny, chat_template=str(qwen))
    export = tmp_path / "epoch_0"
    export.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tiny / name, export / name)
    before = transformers.AutoTokenizer.from_pretrained(export)
    assert before.chat_template != trained.chat_template.text  # the base model's template
    for name, data in trained.extra_files().items():
        (export / name).write_bytes(data)
    served = transformers.AutoTokenizer.from_pretrained(export)
    conversation = CONVERSATIONS["system"]
    ids = served.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert served.chat_template == trained.chat_template.text
    assert list(ids) == apply_chat_template(trained, conversation)
