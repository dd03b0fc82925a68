"""Videos in Qwen2.5-VL and Qwen3-VL, tunelab's own modules against transformers' models.

The tiny random checkpoints of ``test_qwen2_5_vl_hf`` and ``test_qwen3_vl_hf`` (saved by
transformers) get rows with videos: the same random ``pixel_values_videos`` and ids go to both
models, and the logits agree within ``TOLERANCE`` (1e-5; the issue asks 1e-4) for a video
alone, several frame pairs and aspect ratios, one image and one video in one row beside a
video row and a text row (padded), and Qwen2.5-VL's ``second_per_grid_ts`` (the temporal
positions ``tokens_per_second`` apart per second). A Qwen3-VL video is written as the
processor writes it: each frame pair after its timestamp text, in a vision start/end pair of
its own. Each check fails with the family's time axis or deepstack order removed.
"""

import pytest
import torch

from tests.interop.test_qwen2_5_vl_hf import tiny_qwen2_5_vl_config
from tests.interop.test_qwen3_vl_hf import tiny_qwen3_vl_config
from tests.interop.vl_checks import TOLERANCE, save_tiny_checkpoint
from tunelab.models import load_pretrained

transformers = pytest.importorskip("transformers", minversion="5")

IMAGE, VIDEO, START, END = 290, 291, 292, 293
FAMILIES = {
    # family: (HF class, config, patch side)
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", tiny_qwen2_5_vl_config, 14),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", tiny_qwen3_vl_config, 16),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name, config, patch = FAMILIES[request.param]
    hf_class = getattr(transformers, name)
    folder = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    save_tiny_checkpoint(hf_class(config()), folder)
    hf_model = hf_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return request.param, hf_model.eval(), load_pretrained(folder), patch


def _text(generator: torch.Generator, count: int) -> list[int]:
    return torch.randint(0, 280, (count,), generator=generator).tolist()


def _row(family: str, items: list[tuple[str, tuple[int, int, int]]], seed: int) -> list[int]:
    """Text, then each image or video as its processor writes it, then text."""
    generator = torch.Generator().manual_seed(seed)
    ids = _text(generator, 5)
    for kind, (t, h, w) in items:
        per_pair = h * w // 4
        if kind == "image":
            ids += [START] + [IMAGE] * (t * per_pair) + [END]
        elif family == "qwen3_vl":  # "<0.5 seconds>" text before each pair
            for _ in range(t):
                ids += _text(generator, 4) + [START] + [VIDEO] * per_pair + [END]
        else:
            ids += [START] + [VIDEO] * (t * per_pair) + [END]
        ids += _text(generator, 3)
    return ids


def _inputs(rows_items, patch: int, family: str, seconds=None) -> tuple[torch.Tensor, dict]:
    rows = [_row(family, items, seed) for seed, items in enumerate(rows_items)]
    length = max(map(len, rows))
    # Right padding: causal attention keeps the padding out of the real tokens' logits.
    tokens = torch.tensor([row + [0] * (length - len(row)) for row in rows])
    generator = torch.Generator().manual_seed(7)
    kwargs = {}
    for kind, pixels_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        grids = [grid for items in rows_items for k, grid in items if k == kind]
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            kwargs[pixels_key] = torch.randn(patches, 3 * 2 * patch**2, generator=generator)
            kwargs[grid_key] = torch.tensor(grids)
    if seconds is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    return tokens, kwargs


def _gap(family, rows_items, seconds=None, ours_seconds="same") -> float:
    name, hf_model, model, patch = family
    tokens, kwargs = _inputs(rows_items, patch, name, seconds)
    types = (tokens == IMAGE).int() + 2 * (tokens == VIDEO).int()
    hf_kwargs = dict(kwargs)
    if name == "qwen3_vl":
        hf_kwargs.pop("second_per_grid_ts", None)
    ours_kwargs = dict(kwargs)
    if ours_seconds != "same":
        ours_kwargs["second_per_grid_ts"] = ours_seconds
    with torch.no_grad():
        ours = model(tokens, **ours_kwargs)
        theirs = hf_model(input_ids=tokens, mm_token_type_ids=types, **hf_kwargs).logits
    real = [len(_row(name, items, seed)) for seed, items in enumerate(rows_items)]
    return max(float((ours[i, :n] - theirs[i, :n]).abs().max()) for i, n in enumerate(real))


@pytest.mark.parametrize(
    "grid",
    [(1, 4, 4), (2, 4, 6), (3, 6, 4)],
    ids=["one-pair", "two-pairs-wide", "three-pairs-tall"],
)
def test_a_video_alone_matches_transformers(family, grid):
    assert _gap(family, [[("video", grid)]]) <= TOLERANCE


def test_an_image_and_a_video_in_one_row_beside_a_video_row_and_a_text_row(family):
    rows = [
        [("image", (1, 4, 6)), ("video", (2, 4, 4))],
        [("video", (2, 6, 4))],
        [],
    ]
    gap = _gap(family, rows, seconds=[0.5, 2 / 24] if family[0] == "qwen2_5_vl" else None)
    assert gap <= TOLERANCE


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_qwen2_5_vl_temporal_positions_follow_second_per_grid_ts(family):
    """Qwen2.5-VL's frame pairs sit ``tokens_per_second * second_per_grid_ts`` positions apart
    (truncated): equal with the same seconds, different when ours are left at 1 s a pair.
    (Qwen3-VL writes timestamps in the text instead.)"""
    rows = [[("video", (3, 4, 4))], [("video", (2, 4, 4))]]
    seconds = [2 / 24, 1.5]  # 4 * 2/24 = 0.33 a pair: positions 0, 0, 0; 6 a pair
    assert _gap(family, rows, seconds) <= TOLERANCE
    assert _gap(family, rows, seconds, ours_seconds=None) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_deepstack_features_follow_the_sequence_order_of_images_and_videos(family):
    """Qwen3-VL adds each layer's deepstack features at the image and video tokens in their
    order in the sequence: a video before an image, with the order taken wrongly, differs."""
    rows = [[("video", (2, 4, 4)), ("image", (1, 4, 6))]]
    assert _gap(family, rows) <= TOLERANCE
    _, _, model, _ = family
    embed = model.embed

    image_tokens = 4 * 6 // 4

    def swapped(*args, **kwargs):  # the image's features first, then the video's
        h, deepstack = embed(*args, **kwargs)
        return h, [torch.cat((part[-image_tokens:], part[:-image_tokens])) for part in deepstack]

    model.embed = swapped
    try:
        assert _gap(family, rows) > 1e-3
    finally:
        del model.embed


def test_video_tokens_without_their_pixels_or_with_others_are_refused(family):
    name, _, model, patch = family
    tokens, kwargs = _inputs([[("video", (2, 4, 4))]], patch, name)
    with pytest.raises(ValueError, match="no pixel_values_videos"):
        model(tokens)
    kwargs["video_grid_thw"] = torch.tensor([[1, 4, 4]])
    kwargs["pixel_values_videos"] = kwargs["pixel_values_videos"][:16]
    with pytest.raises(ValueError, match="video"):
        model(tokens, **kwargs)
