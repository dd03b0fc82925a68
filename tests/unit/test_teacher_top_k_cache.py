"""The precomputed teacher top-k (tunelab.distill.TeacherTopKCache), in one process.

The loss read from the cache equals the loss with the live teacher's top-k (same k and
temperature) on the same batches, value and gradient; a cache made by another teacher, dtype,
top_k or temperature, copied where this run looks, is refused in one line naming what
differs; a flipped byte is refused by its checksum; nothing is unpickled (the folder holds
JSON and safetensors only).
"""

import json
import shutil

import pytest
import torch

from tunelab._paths import assets_dir
from tunelab.config.sections import ModelSetupArgs
from tunelab.data import instruct_dataset, load_tokenizer, padded_collate_sft
from tunelab.data.preference import IndexedPairs
from tunelab.distill import Teacher, TeacherTopKCache, distill_batch
from tunelab.errors import ConfigError, DataError
from tunelab.losses import ForwardKLLoss, GeneralizedJSDLoss
from tunelab.training import build_model, output_layer

TINY = assets_dir() / "tiny"
NUM_SAMPLES = 12
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("top_k")
    rows = (TINY / "sft.jsonl").read_text().splitlines()[:NUM_SAMPLES]
    (root / "sft.jsonl").write_text("\n".join(rows) + "\n")
    tokenizer = load_tokenizer(TINY, max_seq_len=128)
    dataset = instruct_dataset(
        tokenizer, source=str(root / "sft.jsonl"), template="instruct", cache_dir=str(root / "c")
    )
    cpu = torch.device("cpu")
    student = build_model(ModelSetupArgs(path=str(TINY)), device=cpu, seed=0)
    # Another model as the teacher: the tiny model with its weights perturbed, in a folder.
    teacher_dir = root / "teacher"
    shutil.copytree(TINY, teacher_dir, ignore=shutil.ignore_patterns("*.jsonl"))
    teacher_model = build_model(ModelSetupArgs(path=str(teacher_dir)), device=cpu, seed=0)
    with torch.no_grad():
        for param in teacher_model.parameters():
            param.add_(torch.randn_like(param), alpha=0.05)
    teacher = Teacher(teacher_model, student, chunked=True, teacher_path=str(teacher_dir))
    loader = torch.utils.data.DataLoader(
        IndexedPairs(dataset),
        batch_size=5,
        collate_fn=lambda items: padded_collate_sft(items, tokenizer.pad_id),
    )
    return tokenizer, dataset, student, teacher, teacher_dir, loader


def _cache(setting, loss_fn):
    tokenizer, dataset, _, teacher, teacher_dir, loader = setting
    spot = TeacherTopKCache.locate(
        IndexedPairs(dataset), tokenizer, loss_fn, str(teacher_dir), "fp32"
    )
    return spot, spot.open_or_build(teacher, loss_fn, loader, torch.device("cpu"))


@pytest.mark.parametrize(
    "loss_fn",
    [
        ForwardKLLoss(top_k=8),
        GeneralizedJSDLoss(beta=0.3, top_k=5, temperature=2.0, nll_weight=0.2),
    ],
    ids=["forward_kl_k8", "jsd_k5_t2_nll"],
)
def test_cached_top_k_gives_the_live_teachers_loss_and_gradient(setting, loss_fn):
    _, _, student, teacher, _, loader = setting
    spot, cache = _cache(setting, loss_fn)
    assert not spot.exists  # computed here, from the teacher
    assert sorted(p.name for p in cache.folder.iterdir()) == [
        "manifest.json", "part-00000-of-00001.safetensors"
    ]  # fmt: skip
    output = output_layer(student)
    adapter = [p for p in student.parameters() if p.requires_grad][:3]
    for batch in loader:  # shuffled order is not needed: rows are found by index
        batch = {k: v for k, v in batch.items()}
        results = []
        for source in (teacher, cache):
            student.zero_grad(set_to_none=True)
            sums = distill_batch(loss_fn, student, source, batch, output)
            sums.loss_sum.backward()
            results.append((sums, [p.grad.clone() for p in adapter]))
        (live, live_grads), (cached, cached_grads) = results
        assert cached.num_tokens == live.num_tokens
        torch.testing.assert_close(cached.loss_sum, live.loss_sum, rtol=1e-6, atol=1e-6)
        for name in ("distill", "nll", "student_entropy"):
            torch.testing.assert_close(
                cached.metrics[name], live.metrics[name], rtol=1e-6, atol=1e-6
            )
        for a, b in zip(cached_grads, live_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # A second look finds it (no teacher needed to open it).
    tokenizer, dataset, *_ = setting
    again = TeacherTopKCache.locate(
        IndexedPairs(dataset), tokenizer, loss_fn, str(setting[4]), "fp32"
    )
    assert again.exists and again.folder == spot.folder


def test_a_cache_of_another_teacher_or_setting_is_refused_in_one_line(setting, tmp_path):
    tokenizer, dataset, _, _, teacher_dir, _ = setting
    loss_fn = ForwardKLLoss(top_k=4)
    spot, _ = _cache(setting, loss_fn)
    cases = {
        "loss.top_k": ForwardKLLoss(top_k=3),
        "loss.temperature": ForwardKLLoss(top_k=4, temperature=0.5),
    }
    for field, other_loss in cases.items():
        other = TeacherTopKCache.locate(
            IndexedPairs(dataset), tokenizer, other_loss, str(teacher_dir), "fp32"
        )
        assert other.folder != spot.folder and not other.exists
        shutil.copytree(spot.folder, other.folder)  # forged: this cache where the other looks
        with pytest.raises(DataError, match=field) as refused:
            TeacherTopKCache.open(other.folder, other.key)
        assert "\n" not in str(refused.value) and "delete the folder" in str(refused.value)
    # Another teacher (other weights), and another teacher dtype.
    other_dir = tmp_path / "other_teacher"
    shutil.copytree(teacher_dir, other_dir)
    weights = next(other_dir.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    for path, dtype, field in [
        (other_dir, "fp32", "teacher"),
        (teacher_dir, "bf16", "teacher dtype"),
    ]:
        other = TeacherTopKCache.locate(IndexedPairs(dataset), tokenizer, loss_fn, str(path), dtype)
        assert other.folder != spot.folder
        shutil.copytree(spot.folder, other.folder)
        with pytest.raises(DataError, match=f"another {field}"):
            TeacherTopKCache.open(other.folder, other.key)


def test_a_changed_byte_is_refused_by_its_checksum(setting):
    spot, _ = _cache(setting, ForwardKLLoss(top_k=6))
    part = spot.folder / "part-00000-of-00001.safetensors"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x40  # inside the last logps value
    part.write_bytes(bytes(data))
    with pytest.raises(DataError, match="differs from its checksum"):
        TeacherTopKCache.open(spot.folder, spot.key)
    manifest = json.loads((spot.folder / "manifest.json").read_text())
    manifest["files"] = {"../evil.pkl": next(iter(manifest["files"].values()))}
    (spot.folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="malformed record"):
        TeacherTopKCache.open(spot.folder, spot.key)


def test_without_top_k_or_with_packing_the_setting_is_refused(setting):
    tokenizer, dataset, _, _, teacher_dir, _ = setting
    with pytest.raises(ConfigError, match="needs loss.top_k"):
        TeacherTopKCache.locate(dataset, tokenizer, ForwardKLLoss(), str(teacher_dir), "fp32")
