"""Tool calls, tool results and reasoning train on exactly what transformers renders.

Real templates (Llama 3.1 / 3.2, Qwen 2.5, Qwen3, Mistral Nemo, Phi-3.5; tests/chat_templates)
on tokenizer folders built offline, read by tunelab and ``AutoTokenizer``. Conversations go
through the data path (``read_conversation``: OpenAI rows with ``arguments`` as JSON text), and
transformers renders the messages it returns with the same ``tools``. For every template:

- a conversation that is one sample has the ids of ``apply_chat_template(messages, tools=...)``;
- the trained text of every sample, turn by turn, is what the model generates for that turn:
  ``render(messages[:k + 1])`` after ``render(messages[:k], add_generation_prompt=True)``, cut
  after the first stop token, both rendered by transformers;
- every sample starts with the served prompt of its turns (transformers' ids);
- tool results, system and user text are never trained;
- with ``{% generation %}`` blocks (TRL's Qwen3 training template) the mask equals
  ``return_assistant_tokens_mask``.
"""

import copy
import json

import pytest

from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tunelab.data import load_tokenizer, tokenize_conversation
from tunelab.data.chat import conversation_layout
from tunelab.data.conversations import read_conversation

transformers = pytest.importorskip("transformers")

KWARGS = {"date_string": "26 Jul 2024"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "A city"}},
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOL_RESULTS = ('{"temperature": 22}', '"09:00"', '{"temperature": 25}')


def call(call_id, name, arguments):
    # The OpenAI API's form: arguments as JSON text.
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Parallel calls, their results, a second user turn, a single call, reasoning on every reply.
PARALLEL = [
    SYSTEM,
    {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two lookups at once.",
        "tool_calls": [
            call("call00001", "get_weather", '{"location": "Paris"}'),
            call("call00002", "get_time", {"city": "Tokyo"}),
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call00001",
        "name": "get_weather",
        "content": TOOL_RESULTS[0],
    },
    {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": TOOL_RESULTS[1]},
    {
        "role": "assistant",
        "content": "Sunny and 22 degrees in Paris; 9 am in Tokyo.",
        "reasoning_content": "Both answered.",
    },
    {"role": "user", "content": "And the weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "One more lookup.",
        "tool_calls": [call("call00003", "get_weather", '{"location": "Rome"}')],
    },
    {
        "role": "tool",
        "tool_call_id": "call00003",
        "name": "get_weather",
        "content": TOOL_RESULTS[2],
    },
    {"role": "assistant", "content": "25 degrees in Rome.", "reasoning_content": "Done."},
]


def single_calls(conversation):
    """Llama 3.x takes one call per turn: the parallel turn keeps its first call and result."""
    messages = copy.deepcopy(conversation)
    messages[2]["tool_calls"] = messages[2]["tool_calls"][:1]
    del messages[4]
    return messages


CASES = {
    "qwen2_5": PARALLEL,
    "qwen3": PARALLEL,
    "qwen3_training": PARALLEL,
    "mistral_nemo": PARALLEL,
    "llama3_2": single_calls(PARALLEL),
    "llama3_1": single_calls(PARALLEL),
}
# Samples per conversation: one wherever the whole render shows every turn as generated.
# Qwen3 drops the <think> blocks of the two turns before the second user message: they are
# one more sample (the render ending with the first answer, which shows both as generated).
# Mistral Nemo writes the system prompt into the last user turn only: a sample per turn.
NUM_SAMPLES = {
    "qwen2_5": 1,
    "qwen3": 2,
    "qwen3_training": 1,
    "mistral_nemo": 4,
    "llama3_2": 1,
    "llama3_1": 1,
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tools_hf")
    names = [*CASES, "phi3_5", "qwen2_5_training"]
    folders = {name: make_tokenizer_dir(root / name, SPECS[name]) for name in names}
    return {
        name: (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
        for name, folder in folders.items()
    }


def hf_text(hf_tok, messages, **kwargs):
    return hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)


def hf_ids(hf_tok, messages, **kwargs):
    return list(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def trained_runs(tok, ids, mask):
    runs, run = [], []
    for token, masked in [*zip(ids, mask), (None, True)]:
        if not masked:
            run.append(token)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    return runs


def generated_by_transformers(tok, hf_tok, messages, index, **kwargs):
    """What the model writes for assistant turn ``index``, from transformers' renders alone."""
    prompt = hf_text(hf_tok, messages[:index], add_generation_prompt=True, **kwargs)
    through = hf_text(hf_tok, messages[: index + 1], **kwargs)
    if through.startswith(prompt):
        turn = through[len(prompt) :]
    else:  # Mistral writes the system prompt into the last user turn only; the reply follows
        turn = through.split("[/INST]")[-1]  # the last [/INST]
    stops = [tok.id_to_token(i) for i in tok.stop_ids]
    cut = min((turn.find(s) + len(s) for s in stops if s in turn), default=len(turn))
    return prompt, turn[:cut]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_conversations_train_what_transformers_renders(pairs, name):
    tok, hf_tok = pairs[name]
    messages = read_conversation(CASES[name], "messages")
    options = dict(tools=TOOLS, **KWARGS)
    samples = tokenize_conversation(tok, messages, tools=TOOLS, template_kwargs=KWARGS)
    assert len(samples) == NUM_SAMPLES[name]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    expected = [generated_by_transformers(tok, hf_tok, messages, k, **options) for k in turns]
    if name != "qwen3_training":  # its generation blocks also hold the newline after <|im_end|>
        runs = [run for ids, mask in samples for run in trained_runs(tok, ids, mask)]
        assert sorted(runs) == sorted(generated for _, generated in expected)
    if len(samples) == 1:
        assert samples[0][0] == hf_ids(hf_tok, messages, **options)
    for ids, mask in samples:
        text = tok.decode(ids, skip_special_tokens=False)
        # The sample is the served prompt of some turn, then that turn as generated.
        assert any(text.startswith(prompt + generated) for prompt, generated in expected)
        trained = "".join(trained_runs(tok, ids, mask))
        for never in (*TOOL_RESULTS, "You are a helpful", "weather in Rome?"):
            assert never not in trained
    # The tool calls themselves are trained (Paris appears only in the calls and the reply).
    all_trained = "".join(run for ids, mask in samples for run in trained_runs(tok, ids, mask))
    assert "Paris" in all_trained and "Rome" in all_trained


@pytest.mark.parametrize("name", ["qwen3_training", "qwen2_5_training"])
def test_generation_block_mask_is_return_assistant_tokens_mask(pairs, name):
    tok, hf_tok = pairs[name]
    messages = read_conversation(PARALLEL, "messages")
    out = hf_tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    # The training templates render every turn as generated (Qwen3's keeps every <think>
    # block): one sample, every turn trained.
    ((ids, mask),) = tokenize_conversation(tok, messages, tools=TOOLS)
    assert ids == list(out["input_ids"])
    expected = list(out["assistant_masks"])
    # Qwen 2.5's training template opens its blocks before the newline that ends the role
    # header; that newline is part of the served prompt (add_generation_prompt writes it), so
    # it is never trained: the blocks are clipped to the turn.
    pieces = [tok.decode([token], skip_special_tokens=False) for token in ids]
    header = [
        i
        for i in range(len(ids))
        if pieces[i].endswith("\n") and "".join(pieces[: i + 1]).endswith("<|im_start|>assistant\n")
    ]
    if name == "qwen2_5_training":
        assert [expected[i] for i in header] == [1, 1, 1, 1]
        for i in header:
            expected[i] = 0
    assert [int(not masked) for masked in mask] == expected
    trained = tok.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert trained.count("<tool_call>") == 3 and "Rome" in trained
    assert ("Two lookups at once." in trained) == (name == "qwen3_training")


def test_arguments_text_renders_as_the_parsed_object(pairs):
    # What vLLM serves: arguments given as JSON text are rendered as the object they hold.
    tok, hf_tok = pairs["llama3_2"]
    messages = read_conversation(CASES["llama3_2"], "messages")
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"location": "Paris"}
    text = tok.chat_template.render(messages, tools=TOOLS, template_kwargs=KWARGS)
    assert text == hf_text(hf_tok, messages, tools=TOOLS, **KWARGS)
    assert '"parameters": {"location": "Paris"}' in text


def conversation(num_turns):
    messages = [SYSTEM]
    for k in range(num_turns):
        messages += [
            {"role": "user", "content": f"Next number after {40 + k}:"},
            {"role": "assistant", "content": f"{41 + k}", "reasoning_content": f"{40 + k} + 1"},
        ]
    return messages


def test_phi3_5_multi_turn_is_one_sample_with_every_turn_trained(pairs):
    tok, hf_tok = pairs["phi3_5"]
    messages = conversation(4)
    layout = conversation_layout(tok, messages)
    ((ids, mask),) = layout.samples
    assert layout.reason.startswith("one sample")
    assert ids == hf_ids(hf_tok, messages)
    # Each turn up to the <|end|> it stops at; not the newline, not the final EOS.
    assert trained_runs(tok, ids, mask) == ["41<|end|>", "42<|end|>", "43<|end|>", "44<|end|>"]
    assert tok.decode(ids, skip_special_tokens=False).endswith("44<|end|>\n<|endoftext|>")


def test_qwen3_drops_old_think_blocks_so_it_is_split(pairs):
    tok, hf_tok = pairs["qwen3"]
    messages = conversation(3)
    layout = conversation_layout(tok, messages)
    assert len(layout.samples) == 3
    assert "shows assistant message 2 differently" in layout.reason
    for (ids, mask), k in zip(layout.samples, (2, 4, 6)):
        # Each sample is exactly what transformers serves for turn k, then the turn.
        prompt = hf_ids(hf_tok, messages[:k], add_generation_prompt=True)
        assert ids[: len(prompt)] == prompt
        assert all(mask[: len(prompt)])
        assert trained_runs(tok, ids, mask) == [
            f"<think>\n{40 + k // 2 - 1} + 1\n</think>\n\n{40 + k // 2}<|im_end|>"
        ]
    # With no reasoning anywhere Qwen3 still writes an empty block for the last turn only.
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
    assert len(tokenize_conversation(tok, plain)) == 3


def test_train_on_reasoning_false_keeps_reasoning_as_context(pairs):
    tok, hf_tok = pairs["qwen3"]
    messages = conversation(1)
    ((ids, mask),) = tokenize_conversation(tok, messages, train_on_reasoning=False)
    assert ids == hf_ids(hf_tok, messages)
    assert trained_runs(tok, ids, mask) == ["<think>\n", "\n</think>\n\n41<|im_end|>"]
    ((ids_on, mask_on),) = tokenize_conversation(tok, messages)
    assert trained_runs(tok, ids_on, mask_on) == ["<think>\n40 + 1\n</think>\n\n41<|im_end|>"]


def test_sharegpt_function_call_and_observation_equal_the_openai_rows(pairs):
    tok, _ = pairs["qwen2_5"]
    sharegpt = [
        {"from": "human", "value": "What is the weather in Paris?"},
        {
            "from": "function_call",
            "value": json.dumps({"name": "get_weather", "arguments": {"location": "Paris"}}),
        },
        {"from": "observation", "value": TOOL_RESULTS[0]},
        {"from": "gpt", "value": "Sunny and 22 degrees."},
    ]
    openai = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": TOOL_RESULTS[0]},
        {"role": "assistant", "content": "Sunny and 22 degrees."},
    ]
    ours = tokenize_conversation(tok, read_conversation(sharegpt, "conversations"), tools=TOOLS)
    assert ours == tokenize_conversation(tok, read_conversation(openai, "messages"), tools=TOOLS)
    ((ids, mask),) = ours
    assert trained_runs(tok, ids, mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
        "</tool_call><|im_end|>",
        "Sunny and 22 degrees.<|im_end|>",
    ]
