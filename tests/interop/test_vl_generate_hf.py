"""Greedy generation with image prompts: the rollout engine against transformers' ``generate``.

For tiny random Qwen2.5-VL, Qwen3-VL and Gemma 3 checkpoints saved by transformers, the
rollout engine (``ModelRolloutEngine``: the padded batch prefill with each distinct prompt's
images, the KV cache, M-RoPE decode positions after the prompt's largest one, Gemma 3's
bidirectional image blocks) decodes the same tokens as ``generate`` of the family's
transformers class, prompt by prompt, and each token's log-prob within 1e-4. One call holds a
group of two rows of one prompt, a prompt with two images and a text-only prompt; the vision
tower runs once for the call, over each distinct prompt's images once. Neither side samples
the image token (the engine draws from the other tokens; ``suppress_tokens`` for
transformers); the log-probs compared are the model's own (transformers' raw logits).

Each check can fail: decoding at the cache slots instead of the M-RoPE positions (Qwen), or
with causal attention over the image tokens (Gemma 3), moves the log-probs past the tolerance.
"""

import pytest
import torch

from tests.interop.vl_checks import save_tiny_checkpoint
from tunelab.models import load_pretrained
from tunelab.rl.rollout import ModelRolloutEngine, SamplingSettings

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(
        f"VL generation interop is checked on transformers 5, not {transformers.__version__}",
        allow_module_level=True,
    )

from tests.interop.test_gemma3_vl_hf import SPEC as GEMMA3_SPEC  # noqa: E402
from tests.interop.test_gemma3_vl_hf import tiny_gemma3_config  # noqa: E402
from tests.interop.test_qwen2_5_vl_hf import SPEC as QWEN2_5_SPEC  # noqa: E402
from tests.interop.test_qwen2_5_vl_hf import tiny_qwen2_5_vl_config  # noqa: E402
from tests.interop.test_qwen3_vl_hf import SPEC as QWEN3_SPEC  # noqa: E402
from tests.interop.test_qwen3_vl_hf import tiny_qwen3_vl_config  # noqa: E402

NEW_TOKENS = 10
LOGP_TOLERANCE = 1e-4
FAMILIES = {
    "qwen2_5_vl": (QWEN2_5_SPEC, tiny_qwen2_5_vl_config, [(1, 4, 6)], [(1, 6, 4), (1, 4, 4)]),
    "qwen3_vl": (QWEN3_SPEC, tiny_qwen3_vl_config, [(1, 4, 6)], [(1, 6, 4), (1, 4, 4)]),
    # Gemma 3: each grid stands for one image of fixed size.
    "gemma3": (GEMMA3_SPEC, tiny_gemma3_config, [None], [None, None]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """``(spec, transformers' model, ours, prompts)``; prompts are ``(ids, images)``."""
    spec, config, one, two = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_class = spec.hf_class
    folder = save_tiny_checkpoint(hf_class(config()), tmp_path_factory.mktemp(request.param))
    if request.param == "gemma3":
        from tunelab.assets.build_tiny_vl import gemma3_hub_layout

        folder = gemma3_hub_layout(folder)
    hf_model = spec.load_hf(folder)
    # No stop token on either side: every completion runs NEW_TOKENS tokens.
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    prompts = [
        (spec.row(one, seed=1), spec.images(one, seed=1)),
        (spec.row(two, text=3, seed=2), spec.images(two, seed=2)),
        (spec.row([], text=7, seed=3), {}),
    ]
    return request.param, spec, hf_model, load_pretrained(folder), prompts


def _theirs(spec, hf_model, ids: list[int], images: dict) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-prob (raw logits, log-softmaxed)."""
    tokens = torch.tensor([ids])
    out = hf_model.generate(
        **spec.hf_inputs(tokens, images),
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        suppress_tokens=[spec.image],
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    logps = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token])
        for step, token in zip(out.logits, new, strict=True)
    ]
    return new, logps


def _ours(model, prompts, rows: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    engine = ModelRolloutEngine(
        model, SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=0.0), pad_id=0
    )
    images = [prompts[row][1] or None for row in rows]
    completions = engine.generate([prompts[row][0] for row in rows], [0] * len(rows), images)
    return completions, engine.last_logps


# A group of two rows of prompt 0, then prompt 1 (two images), prompt 2 (text), prompt 0 again.
ROWS = [0, 0, 1, 2, 0]


def _gap(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(ours, theirs, strict=True))


def test_greedy_generation_equals_transformers(family):
    name, spec, hf_model, model, prompts = family
    tokens, logps = _ours(model, prompts, ROWS)
    gaps = []
    for row, prompt in enumerate(ROWS):
        their_tokens, their_logps = _theirs(spec, hf_model, *prompts[prompt])
        assert tokens[row] == their_tokens, (name, row)
        gaps.append(_gap(logps[row], their_logps))
    print(f"{name}: greedy tokens equal, log-prob gap {max(gaps):.1e}")
    assert max(gaps) <= LOGP_TOLERANCE


def test_the_tower_runs_once_per_distinct_prompt(family):
    name, spec, _, model, prompts = family
    tower = model.vision_tower if name == "gemma3" else model.visual
    calls = []
    handle = tower.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        _ours(model, prompts, ROWS)
    finally:
        handle.remove()
    # One prefill: prompt 0's images once (its three rows share them) and prompt 1's two.
    distinct = [prompts[p][1]["pixel_values"].shape[0] for p in (0, 1)]
    assert calls == [sum(distinct)], (calls, distinct)


def test_the_decode_positions_and_image_blocks_matter(family, monkeypatch):
    """Qwen: decoding at the cache slots (no M-RoPE offset); Gemma 3: causal attention over
    the image tokens. Either leaves transformers' log-probs by more than the tolerance."""
    name, spec, hf_model, model, prompts = family
    if name == "gemma3":
        import tunelab.models.vision_language_gemma3 as gemma3

        monkeypatch.setattr(gemma3, "image_block_ends", lambda is_image: None)
    else:
        from tunelab.modules.kv_cache import KVCache

        original = KVCache.select_rows

        def forget_offsets(self, index):
            original(self, index)
            self.position_offsets = None

        monkeypatch.setattr(KVCache, "select_rows", forget_offsets)
    _, logps = _ours(model, prompts, [0])
    _, their_logps = _theirs(spec, hf_model, *prompts[0])
    assert _gap(logps[0], their_logps) > LOGP_TOLERANCE
