"""Tokenizer: special tokens from the config files, encode/decode, stop ids, bad input."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from tunelab._paths import assets_dir
from tunelab.data import load_tokenizer
from tunelab.errors import DataError

TINY = assets_dir() / "tiny"
WORDS = ["<s>", "</s>", "<pad>", "<|im_end|>", "hello", "world", "[UNK]"]


def _word_tokenizer(folder: Path, *, bos_post_processor: bool = False, **config) -> Path:
    """A word-level tokenizer.json (ids = WORDS order) plus the given tokenizer_config keys."""
    tokenizer = HFTokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>", "<|im_end|>"])
    if bos_post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_tiny_special_tokens_and_stop_ids():
    tok = load_tokenizer(TINY, max_seq_len=64)
    # build_tiny gives the special tokens ids 0-7 in this order.
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.token_to_id("<|eot_id|>") == 5 and tok.token_to_id("<|im_end|>") == 7
    assert tok.stop_ids == (1, 5, 7)
    assert tok.add_bos_token and tok.max_seq_len == 64
    assert tok.vocab_size == HFTokenizer.from_file(str(TINY / "tokenizer.json")).get_vocab_size()
    assert tok.token_to_id("no such token") is None


def test_tiny_encode_decode():
    tok = load_tokenizer(TINY / "tokenizer.json")  # the file path works as well as the folder
    plain = tok.encode("red cat", add_bos=False)
    assert tok.encode("red cat") == [0, *plain]
    assert tok.encode("red cat", add_eos=True) == [0, *plain, 1]
    assert tok.decode(tok.encode("red cat sun 42")) == "red cat sun 42"
    # Special tokens written in the text are recognised, and skipped on decode by default.
    ids = tok.encode("a<|eot_id|>b", add_bos=False)
    assert 5 in ids
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|eot_id|>b"


def test_pad_falls_back_to_eos_and_config_wins_over_map(tmp_path):
    folder = _word_tokenizer(tmp_path / "t", bos_token="<s>", eos_token="</s>")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}})
    )
    tok = load_tokenizer(folder)
    assert tok.eos_id == 1  # tokenizer_config.json wins
    assert tok.pad_id == 2  # special_tokens_map.json fills the gap (AddedToken dict form)
    (folder / "special_tokens_map.json").unlink()
    assert load_tokenizer(folder).pad_id == 1  # no pad: pad with eos


def test_null_bos_means_none(tmp_path):
    folder = _word_tokenizer(tmp_path / "t", bos_token=None, eos_token="<|im_end|>")
    tok = load_tokenizer(folder)
    assert tok.bos_id is None and not tok.add_bos_token
    assert tok.encode("hello world") == [4, 5]
    assert tok.stop_ids == (3,)


def test_add_bos_token_from_config_or_post_processor(tmp_path):
    off = _word_tokenizer(tmp_path / "off", bos_token="<s>", eos_token="</s>", add_bos_token=False)
    assert load_tokenizer(off).encode("hello") == [4]
    # No add_bos_token key: follow tokenizer.json's post-processor, as transformers does.
    with_post = _word_tokenizer(
        tmp_path / "post", bos_post_processor=True, bos_token="<s>", eos_token="</s>"
    )
    assert load_tokenizer(with_post).encode("hello") == [0, 4]
    without = _word_tokenizer(tmp_path / "plain", bos_token="<s>", eos_token="</s>")
    assert load_tokenizer(without).encode("hello") == [4]


def test_generation_config_adds_stop_ids(tmp_path):
    folder = _word_tokenizer(tmp_path / "t", bos_token="<s>", eos_token="</s>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    assert load_tokenizer(folder).stop_ids == (1, 3, 4)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="tokenizer file not found: .*tokenizer.json"):
        load_tokenizer(tmp_path)


def test_corrupt_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path)


def test_unknown_special_token(tmp_path):
    folder = _word_tokenizer(tmp_path / "t", bos_token="<s>", eos_token="<eos>")
    with pytest.raises(DataError, match=r"eos_token '<eos>' is not in the vocabulary"):
        load_tokenizer(folder)


def test_no_eos_anywhere(tmp_path):
    folder = _word_tokenizer(tmp_path / "t")
    with pytest.raises(DataError, match="no eos_token"):
        load_tokenizer(folder)


QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "chat_templates" / "qwen2_5_instruct.jinja"


def test_export_files_carry_an_overridden_chat_template():
    assert load_tokenizer(TINY).extra_files() == {}
    # Naming the folder's own default is no override.
    assert load_tokenizer(TINY, chat_template="default").extra_files() == {}
    for choice in (str(QWEN_TEMPLATE), QWEN_TEMPLATE.read_text()):
        files = load_tokenizer(TINY, chat_template=choice).extra_files()
        assert files == {"chat_template.jinja": QWEN_TEMPLATE.read_bytes()}


def test_fingerprint_follows_what_decides_the_ids_and_pickles():
    import pickle

    tok = load_tokenizer(TINY)
    assert tok.fingerprint == load_tokenizer(TINY, max_seq_len=7).fingerprint
    assert tok.fingerprint != load_tokenizer(TINY, chat_template=str(QWEN_TEMPLATE)).fingerprint
    tok.chat_template.check()  # compiled: the copy must not carry the compiled template
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.fingerprint == tok.fingerprint
    messages = [{"role": "user", "content": "hi"}]
    assert copy.chat_template.render(messages) == tok.chat_template.render(messages)


def test_a_vocabulary_of_special_tokens_only_is_refused(tmp_path):
    # Every word would become <unk>: a run with it trains to the end and learns nothing.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "</s>": 2}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>", "pad_token": "<pad>"}')
    with pytest.raises(DataError, match=r"tokenizer\.json: the vocabulary holds only special"):
        load_tokenizer(tmp_path)
    # One ordinary word is enough: a small vocabulary is not refused for being small.
    hf = HFTokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "</s>": 2, "red": 3}, "<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).vocab_size == 4
