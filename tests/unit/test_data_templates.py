"""Templates: exact token sequences and loss masks, hand-checked on the tiny tokenizer."""

import pytest

from tunelab._paths import assets_dir
from tunelab.data import Message, get_template, load_tokenizer, tokenize_messages
from tunelab.errors import ConfigError, DataError

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(assets_dir() / "tiny")


def render(tok, messages, template, **kwargs):
    """Token pieces as text, and 1 where the token is trained (0 where masked)."""
    ids, mask = tokenize_messages(tok, messages, template, **kwargs)
    return [tok.decode([i], skip_special_tokens=False) for i in ids], [int(not m) for m in mask]


def test_special_token_ids_are_the_generated_ones(tok):
    # The exact pieces below rely on these ids (build_tiny puts the specials first).
    assert [tok.token_to_id(t) for t in SPECIAL] == list(range(8))


def test_llama3(tok):
    messages = [
        Message("system", "Be brief.", masked=True),
        Message("user", "Next number after 41:", masked=True),
        Message("assistant", "42"),
    ]
    pieces, trained = render(tok, messages, "llama3")
    # fmt: off
    assert pieces == [
        "<|begin_of_text|>",
        "<|start_header_id|>", "system", "<|end_header_id|>", "\n\n",
        "B", "e", " b", "r", "i", "e", "f", ".", "<|eot_id|>",
        "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n",
        "Next", " number", " after", " ", "41", ":", "<|eot_id|>",
        "<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n",
        "42", "<|eot_id|>",
    ]
    # fmt: on
    assert trained == [0] * 29 + [1, 1]  # the answer and its <|eot_id|>; not the header


def test_chatml(tok):
    messages = [Message("user", "Next number after 41:", masked=True), Message("assistant", "42")]
    pieces, trained = render(tok, messages, "chatml")
    # fmt: off
    assert pieces == [
        "<|im_start|>", "user", "\n", "Next", " number", " after", " ", "41", ":", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "42", "<|im_end|>", "\n",
    ]
    # fmt: on
    assert trained == [0] * 14 + [1, 1, 0]  # the newline after <|im_end|> is never trained


def test_instruct_with_input(tok):
    template = get_template("instruct")
    user = template.join_instruction("Reverse the words.", "red cat")
    messages = [Message("user", user, masked=True), Message("assistant", "cat red")]
    pieces, trained = render(tok, messages, template)
    # fmt: off
    assert pieces == [
        "<|begin_of_text|>", "###", " Instruction", ":\n", "Reverse", " the", " words", ".\n\n",
        "###", " Input", ":\n", "red", " cat", "\n\n", "###", " Response", ":\n",
        "cat", " red", "<|end_of_text|>",
    ]
    # fmt: on
    assert trained == [0] * 17 + [1, 1, 1]
    assert template.join_instruction("Count.", "") == "Count."
    assert get_template("llama3").join_instruction("Count.", "a b") == "Count.\n\na b"


@pytest.mark.parametrize(
    ("template", "header"),
    [
        ("llama3", ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"]),
        ("chatml", ["<|im_start|>", "assistant", "\n"]),
        ("instruct", ["###", " Response", ":\n"]),
    ],
)
def test_generation_prompt(tok, template, header):
    messages = [Message("user", "Next number after 41:", masked=True)]
    without, _ = render(tok, messages, template)
    pieces, trained = render(tok, messages, template, add_generation_prompt=True)
    assert pieces == without + header
    assert not any(trained)


def test_generation_prompt_is_the_training_prefix(tok):
    # What generate feeds the model must equal the prefix the model was trained on.
    for template in ("llama3", "chatml", "instruct"):
        prompt = [Message("user", "Sort the letters: c a b", masked=True)]
        ids, _ = tokenize_messages(tok, prompt, template, add_generation_prompt=True)
        full, mask = tokenize_messages(tok, [*prompt, Message("assistant", "a b c")], template)
        assert full[: len(ids)] == ids
        assert all(mask[: len(ids)]) and not any(mask[len(ids) :][:3])


def test_unmasked_user_turn_keeps_headers_masked(tok):
    messages = [Message("user", "hi"), Message("assistant", "42")]
    pieces, trained = render(tok, messages, "llama3")
    assert pieces[4:7] == ["\n\n", "hi", "<|eot_id|>"]
    assert trained[:5] == [0, 0, 0, 0, 0] and trained[5:7] == [1, 1]


def test_straddling_token_takes_its_last_characters_mask(tok):
    # ":" ends the (trained) user content and "\n" starts the (masked) separator; the tiny
    # tokenizer merges them into ":\n", which therefore counts as masked.
    pieces, trained = render(
        tok, [Message("user", "after 41:"), Message("assistant", "42")], "instruct"
    )
    index = pieces.index(":\n", 4)
    assert pieces[index - 1] == "41" and trained[index - 1] == 1 and trained[index] == 0


def test_unknown_template_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown template 'llama' .*did you mean 'llama3'\?"):
        get_template("llama")


def test_template_needs_its_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"</s>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["</s>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>", "bos_token": null}')
    tok = load_tokenizer(tmp_path)
    with pytest.raises(
        DataError, match=r"template 'chatml' needs the special token '<\|im_start\|>'"
    ):
        tokenize_messages(tok, [Message("user", "hi")], "chatml")
    # The instruct template needs only EOS, and adds no BOS when the tokenizer has none.
    ids, _ = tokenize_messages(tok, [Message("assistant", "hi")], "instruct")
    assert ids[-1] == 0 and ids[0] != 0
