"""Agentic episodes are token in, token out, and their ids are the chat template's render.

A replaying policy writes, each turn, exactly the reply ``transformers`` renders for a reference
conversation (Qwen3 with reasoning and parallel calls; Mistral Nemo, whose [TOOL_CALLS] carry
9-character ids, with the same conversation, its template leaving the reasoning out; Llama 3.1
with one call per turn). Every other token of the episode comes from tunelab: the prompt's
render, the real calculator's results, and the template's deltas after each reply. The whole episode must equal
``apply_chat_template(messages, tools=...)`` of the reference conversation, the parsed messages
must render to the same ids, and the trained positions must be exactly the replies.
"""

import pytest

from tests.agentic_replay import ReplayPolicy
from tests.chat_templates._build import SPECS, make_tokenizer_dir
from tunelab.data import load_tokenizer
from tunelab.rl.agentic import EpisodeLimits, EpisodeRunner, Toolbox, calculator
from tunelab.rl.agentic.tools import tool_from_function

transformers = pytest.importorskip("transformers")

KWARGS = {"date_string": "26 Jul 2024"}
SCHEMA = tool_from_function(calculator, "test").schema
USER = {"role": "user", "content": "What is (3 + 4) * 2, and 5 - 1? Use the calculator."}


def calc(call_id, expression):
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


def result(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "name": "calculator", "content": content}


QWEN3 = [
    USER,
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two sums at once.",
        "tool_calls": [calc("c00000000", "(3 + 4) * 2"), calc("c00000001", "5 - 1")],
    },
    result("c00000000", "14"),
    result("c00000001", "4"),
    {"role": "assistant", "content": "", "reasoning_content": "Check one.",
     "tool_calls": [calc("c00100000", "14 + 4")]},
    result("c00100000", "18"),
    {"role": "assistant", "content": "14 and 4.", "reasoning_content": "Done."},
]  # fmt: skip
LLAMA3_1 = [
    USER,
    {"role": "assistant", "content": "", "tool_calls": [calc("c00000000", "(3 + 4) * 2")]},
    result("c00000000", "14"),
    {"role": "assistant", "content": "", "tool_calls": [calc("c00100000", "5 - 1")]},
    result("c00100000", "4"),
    {"role": "assistant", "content": "14 and 4."},
]
CASES = {"qwen3": QWEN3, "llama3_1": LLAMA3_1, "mistral_nemo": QWEN3}  # Mistral: no reasoning


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic_hf")
    folders = {name: make_tokenizer_dir(root / name, SPECS[name]) for name in CASES}
    return {
        name: (load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))
        for name, folder in folders.items()
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_episode_ids_equal_transformers_render(tokenizers, name):
    tok, hf_tok = tokenizers[name]
    reference = CASES[name]
    ids = list(
        hf_tok.apply_chat_template(
            reference, tools=[SCHEMA], tokenize=True, return_dict=False, **KWARGS
        )
    )
    policy = ReplayPolicy(ids, tok.stop_ids)
    runner = EpisodeRunner(
        policy, tok, tok.chat_template, Toolbox([calculator]),
        EpisodeLimits(max_turns=5, max_episode_tokens=2000), template_kwargs=KWARGS,
    )  # fmt: skip
    (episode,) = runner.run([(reference[:1], {})], [0])

    assert episode.stop_reason == "answer"
    assert episode.num_turns == sum(m["role"] == "assistant" for m in reference)
    assert episode.num_tool_calls == sum(m["role"] == "tool" for m in reference)
    assert not episode.tool_errors
    whole = episode.prompt_tokens + episode.tokens
    # The reference ends after the last stop token with the template's trailing text ("\n").
    assert whole == ids[: len(whole)]
    assert tok.decode(ids[len(whole) :], skip_special_tokens=False).strip() == ""
    # The parsed conversation (calls, real calculator results, reasoning) renders the same.
    again = hf_tok.apply_chat_template(
        episode.messages, tools=[SCHEMA], tokenize=True, return_dict=False, **KWARGS
    )
    assert list(again) == ids
    # Trained: exactly the replies, in order; the prompt and every delta untrained.
    trained = [t for t, keep in zip(episode.tokens, episode.trained, strict=True) if keep]
    assert trained == [t for reply in policy.replies[0] for t in reply]
    assert sum(map(len, policy.fed[0])) + len(trained) == len(whole)
    assert policy.fed[0][0] == episode.prompt_tokens
    tool_text = tok.decode(
        [t for t, keep in zip(episode.tokens, episode.trained, strict=True) if not keep],
        skip_special_tokens=False,
    )
    for message in reference:
        if message["role"] == "tool":
            assert message["content"] in tool_text
