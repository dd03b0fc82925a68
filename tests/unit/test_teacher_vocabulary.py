"""A distillation teacher whose vocabulary differs from the student's only in special tokens.

The teacher here is the tiny model itself with two special tokens' ids swapped (embedding rows
and tokenizer alike) and one special token of its own added: mapped by content, its logits in
the student's order, and so the distillation loss, equal the unpermuted teacher's. Any other
tokenizer difference, or a student special token the teacher lacks, is refused in one line.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tunelab._paths import assets_dir
from tunelab.config._teacher_vocab import map_vocabularies
from tunelab.config.sections import ModelSetupArgs
from tunelab.distill import Teacher, distill_batch
from tunelab.errors import ConfigError
from tunelab.losses import ReverseKLLoss
from tunelab.training import build_model, forward, output_layer

TINY = assets_dir() / "tiny"
SWAPPED = ("<|eot_id|>", "<|im_end|>")
EXTRA = "<|teacher_only|>"


def _teacher_folder(root, *, swap=True, extra=True, ordinary_swap=False):
    folder = root / "teacher"
    shutil.copytree(TINY, folder, ignore=shutil.ignore_patterns("*.jsonl"))
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    weights = load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    names = list(SWAPPED) if swap else []
    if ordinary_swap:
        names = ["red", "blue"]
    if names:
        a, b = (vocab[name] for name in names)
        vocab[names[0]], vocab[names[1]] = b, a
        for token in tokenizer["added_tokens"]:
            if token["content"] in names:
                token["id"] = b if token["id"] == a else a
        embed[[a, b]] = embed[[b, a]]
    size = embed.shape[0]
    if extra:
        tokenizer["added_tokens"].append(
            {**tokenizer["added_tokens"][0], "id": size, "content": EXTRA}
        )
        vocab[EXTRA] = size
        embed = torch.cat([embed, torch.randn(1, embed.shape[1]) * 0.02])
        size += 1
    weights["model.embed_tokens.weight"] = embed.contiguous()
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = size
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_special_tokens_are_mapped_by_content_and_the_loss_is_the_unpermuted_teachers(
    tmp_path, capsys
):
    folder = _teacher_folder(tmp_path)
    vocabulary = map_vocabularies(TINY, folder, 810, 811)
    eot, im_end = (
        json.loads((TINY / "tokenizer.json").read_text())["model"]["vocab"][n] for n in SWAPPED
    )
    assert vocabulary.mapped == [(SWAPPED[0], eot, im_end), (SWAPPED[1], im_end, eot)]
    assert vocabulary.left_out == [EXTRA]
    cpu = torch.device("cpu")
    student = build_model(ModelSetupArgs(path=str(TINY)), device=cpu, seed=0)
    plain = Teacher(
        build_model(ModelSetupArgs(path=str(TINY)), device=cpu, seed=0), student, chunked=True,
        teacher_path=str(TINY), student_tokenizer=str(TINY),
    )  # fmt: skip
    assert capsys.readouterr().out == ""  # nothing to map, nothing said
    mapped = Teacher(
        build_model(ModelSetupArgs(path=str(folder)), device=cpu, seed=0), student, chunked=True,
        teacher_path=str(folder), student_tokenizer=str(TINY),
    )  # fmt: skip
    (line,) = capsys.readouterr().out.splitlines()
    assert f"{SWAPPED[0]} {im_end}->{eot}" in line and EXTRA in line, line
    # A batch that holds both swapped tokens as inputs and as labels.
    tokens = torch.tensor([[0, 300, eot, 41, im_end, 17, 1], [0, im_end, 55, eot, 9, 1, 2]])
    labels = tokens.clone()
    labels[1, -1] = -100
    batch = {"tokens": tokens, "labels": labels}
    output = output_layer(student)
    loss_fn = ReverseKLLoss(temperature=1.5)
    want = distill_batch(loss_fn, student, plain, batch, output)
    got = distill_batch(loss_fn, student, mapped, batch, output)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-6, atol=1e-6)
    for name in want.metrics:
        torch.testing.assert_close(got.metrics[name], want.metrics[name], rtol=1e-6, atol=1e-6)
    # Unchunked (whole logits): the same logits in the student's order.
    whole = Teacher(mapped.model, student, chunked=False, teacher_path=str(folder),
                    student_tokenizer=str(TINY))  # fmt: skip
    reference = Teacher(plain.model, student, chunked=False, teacher_path=str(TINY))
    torch.testing.assert_close(whole.states(batch), reference.states(batch), rtol=1e-6, atol=1e-6)
    # Without the map the permuted teacher's logits differ: the test can fail.
    with torch.no_grad():
        raw = forward(mapped.model, batch)[..., :810]
    assert (raw - reference.states(batch)).abs().max() > 1e-2


def test_other_differences_are_refused_in_one_line(tmp_path):
    folder = _teacher_folder(tmp_path, swap=False, extra=False, ordinary_swap=True)
    with pytest.raises(ValueError, match="beyond special tokens") as refused:
        map_vocabularies(TINY, folder, 810, 810)
    assert "\n" not in str(refused.value)
    cpu = torch.device("cpu")
    student = build_model(ModelSetupArgs(path=str(TINY)), device=cpu, seed=0)
    with pytest.raises(ConfigError, match="^teacher.path: .*beyond special tokens"):
        Teacher(
            student, student, chunked=True, teacher_path=str(folder), student_tokenizer=str(TINY)
        )
    # A student special token the teacher lacks cannot be scored.
    student_side = tmp_path / "student"
    shutil.copytree(TINY, student_side, ignore=shutil.ignore_patterns("*.jsonl", "*.safetensors"))
    tokenizer = json.loads((student_side / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append(
        {**tokenizer["added_tokens"][0], "id": 810, "content": "<|new|>"}
    )
    (student_side / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"special tokens \['<\|new\|>'\] are not in the teacher"):
        map_vocabularies(student_side, TINY, 811, 810)
