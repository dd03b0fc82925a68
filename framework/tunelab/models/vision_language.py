"""A decoder that reads images: Qwen2.5-VL's or Qwen3-VL's vision tower, image tokens, M-RoPE.

The language model is tunelab's ``TransformerDecoder`` unchanged; what differs is its input:

* each image's embeddings (``tunelab.modules.vision.VisionTransformer``) replace the
  embeddings of that image's ``image_token_id`` tokens, image after image;
* rotary positions are 3D (multimodal RoPE, M-RoPE; Qwen2-VL, Wang et al., 2024,
  https://arxiv.org/abs/2409.12191): a text token has the same position ``p`` on all three
  axes; an image's tokens, a grid of ``t x h x w``, have ``(s + frame, s + row, s + column)``
  with ``s`` the position after the text before it, and the text after the image resumes at
  ``s + max(h, w)``. Rotary frequency ``i`` of a head follows the temporal, height or width
  position depending on which of the ``mrope_section`` sizes it falls in;
* a video (``pixel_values_videos``, ``video_grid_thw``: frames in pairs, ``t`` pairs of
  ``h x w`` patches) goes through the same tower into its ``video_token_id`` tokens. Qwen2.5-VL
  spaces its temporal positions by ``tokens_per_second * second_per_grid_ts`` (one video's
  tokens in one run); Qwen3-VL writes each pair's timestamp in the text, so each pair is a run
  of its own, positioned as an image of one frame.

Parameter names are the hub checkpoints' (``visual.*``, ``model.*``, ``lm_head.weight``).
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tunelab.distributed._fqn import clean_fqn
from tunelab.models.args import FULL, ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules.masks import positions_from_document_ids
from tunelab.modules.vision import VisionTransformer
from tunelab.modules.vision_qwen3 import Qwen3VisionTransformer


@dataclass(frozen=True)
class VideoSpans:
    """Where a batch's videos sit for M-RoPE: each run of video tokens and its time axis."""

    token_id: int
    """The token a video's embeddings replace."""
    grid_thw: torch.Tensor
    """Long ``[runs, 3]``: one run of consecutive video tokens each, row after row (a whole
    video for Qwen2.5-VL; one frame pair, ``t = 1``, for Qwen3-VL)."""
    intervals: torch.Tensor | None = None
    """fp32 ``[runs]``: temporal positions per frame pair (Qwen2.5-VL's ``tokens_per_second *
    second_per_grid_ts``, truncated as transformers does); None: 1."""

    def temporal(self, run: int, frames: int) -> list[int]:
        """The temporal offsets of run ``run``'s ``frames`` frame pairs."""
        if self.intervals is None:
            return list(range(frames))
        return (torch.arange(frames) * self.intervals[run]).long().tolist()


def _add_deepstack(
    h: torch.Tensor,
    is_visual: torch.Tensor,
    visual_index: torch.Tensor,
    features: torch.Tensor,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """``h`` plus one layer's deepstack ``features`` at its visual tokens.

    ``features`` is ``[visual tokens, dim]``, in sequence order; ``h`` is ``[batch, seq,
    dim]``, or with ``rows`` the ``[rows, dim]`` of those positions of ``[batch * seq]``.
    ``visual_index`` is ``is_visual.reshape(-1).nonzero()``'s column, computed once a forward:
    one ``index_add`` (its backward passes ``h``'s gradient through whole) instead of a boolean
    gather and ``masked_scatter`` (whose backward gathers and zero-fills).
    """
    if rows is None:
        flat = h.reshape(-1, h.shape[-1])
        return flat.index_add(0, visual_index, features.to(h.dtype)).view_as(h)
    visual = is_visual.reshape(-1)
    # Each position's place among the visual tokens, read at the rows that are visual.
    rank = visual.cumsum(0).index_select(0, rows) - 1
    picked = torch.where(visual.index_select(0, rows), rank, -1)
    chosen = (picked >= 0).nonzero().squeeze(-1)
    added = features.index_select(0, picked.index_select(0, chosen)).to(h.dtype)
    return h.index_add(0, chosen, added)


def multimodal_positions(
    tokens: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    merge_size: int,
    document_ids: torch.Tensor | None = None,
    videos: VideoSpans | None = None,
) -> torch.Tensor:
    """M-RoPE positions of a batch, images and videos in the order the rows hold them.

    Args:
        tokens: long ``[batch, seq]``.
        image_grid_thw: long ``[images, 3]`` (frames, patch rows, patch columns) of every
            image in the batch, row after row; None for no images.
        image_token_id: the token an image's embeddings replace.
        merge_size: the vision tower's ``spatial_merge_size``.
        document_ids: ``[batch, seq]`` of packed rows: positions restart at each document.
        videos: the batch's runs of video tokens; None for no videos.

    Returns:
        Long ``[3, batch, seq]``: temporal, height and width positions.

    Raises:
        ValueError: the image or video tokens do not match the grids.
    """
    batch, seq_len = tokens.shape
    # token id -> (grids, temporal offsets of run k)
    kinds: dict[int, tuple[list, object]] = {}
    if image_grid_thw is not None:
        kinds[image_token_id] = (
            [tuple(grid) for grid in image_grid_thw.tolist()],
            lambda run, frames: list(range(frames)),
        )
    if videos is not None:
        kinds[videos.token_id] = (
            [tuple(grid) for grid in videos.grid_thw.tolist()],
            videos.temporal,
        )
    is_vision = torch.zeros_like(tokens, dtype=torch.bool)
    for token_id in kinds:
        is_vision |= tokens == token_id
    if not kinds or not bool(is_vision.any()):
        if document_ids is None:
            flat = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
        else:
            flat = positions_from_document_ids(document_ids)
        return flat[None].expand(3, batch, seq_len)
    used = dict.fromkeys(kinds, 0)
    # Plain lists and numpy: a per-token loop over tensor elements cost ~10 ms a batch.
    positions = np.empty((3, batch, seq_len), dtype=np.int64)
    token_rows = torch.where(is_vision, tokens, -1).cpu().tolist()
    if document_ids is None:
        starts = [[True] + [False] * (seq_len - 1) for _ in range(batch)]
    else:
        document_ids = document_ids.cpu()
        begins = torch.ones(batch, seq_len, dtype=torch.bool)
        begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        starts = begins.tolist()
    for row in range(batch):
        kind_row, begins_row = token_rows[row], starts[row]
        index, current = 0, 0
        while index < seq_len:
            if begins_row[index]:
                current = 0
            kind = kind_row[index]
            if kind < 0:
                # A text run: to the next image or video token or document start.
                end = index + 1
                while end < seq_len and kind_row[end] < 0 and not begins_row[end]:
                    end += 1
                positions[:, row, index:end] = np.arange(current, current + end - index)
                current, index = current + end - index, end
                continue
            grids, temporal = kinds[kind]
            number = used[kind]
            name = "image" if kind == image_token_id and image_grid_thw is not None else "video"
            if number >= len(grids):
                raise ValueError(f"more {name} tokens than the {name} grids describe")
            frames, rows, columns = grids[number]
            used[kind] += 1
            rows, columns = rows // merge_size, columns // merge_size
            count = frames * rows * columns
            if index + count > seq_len or any(k != kind for k in kind_row[index : index + count]):
                raise ValueError(
                    f"row {row}: {name} {number} needs {count} consecutive {name} tokens "
                    f"at position {index}"
                )
            grid = np.indices((frames, rows, columns)).reshape(3, -1)
            grid[0] = np.asarray(temporal(number, frames), dtype=np.int64)[grid[0]]
            positions[:, row, index : index + count] = grid + current
            current += max(rows, columns)
            index += count
    for kind, (grids, _) in kinds.items():
        if used[kind] != len(grids):
            name = "image" if kind == image_token_id and image_grid_thw is not None else "video"
            raise ValueError(
                f"the {name} grids describe {len(grids)} {name}s but the tokens hold {used[kind]}"
            )
    return torch.from_numpy(positions).to(tokens.device)


def multimodal_rotary(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    sections: list[int],
    dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[batch, seq, 2 * sum(sections)]`` of M-RoPE positions.

    Args:
        inv_freq: the ``head_dim / 2`` rotary inverse frequencies.
        positions: long ``[3, batch, seq]``.
        sections: frequencies that follow the temporal, height and width positions.
        dtype: dtype of the tables.
        interleaved: Qwen3-VL's layout: frequency ``i`` follows the height when
            ``i % 3 == 1 and i < 3 * sections[1]``, the width when
            ``i % 3 == 2 and i < 3 * sections[2]``, else the time. Otherwise the sections
            are consecutive (Qwen2.5-VL).

    Returns:
        The tables, in the "rotate half" layout of ``tunelab.modules.rotary``.
    """
    if interleaved:
        axis = torch.zeros(sum(sections), dtype=torch.long)
        for index in (1, 2):
            axis[index : 3 * sections[index] : 3] = index
    else:
        axis = torch.cat(
            [torch.full((size,), index, dtype=torch.long) for index, size in enumerate(sections)]
        )
    axis = axis.to(positions.device)
    chosen = positions.float().permute(1, 2, 0)[..., axis]  # [batch, seq, head_dim / 2]
    angles = chosen * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class VisionLanguageDecoder(TransformerDecoder):
    """``TransformerDecoder`` plus a vision tower: HF's Qwen2.5-VL or Qwen3-VL model.

    The tower is ``args.vision.layout``'s: transformers' ``Qwen2_5_VLForConditionalGeneration``
    or ``Qwen3VLForConditionalGeneration``.

    Args:
        args: the model's arguments, ``args.vision`` and ``args.mrope_section`` set.
    """

    vision_prefix = "visual."
    """Where the vision tower and projector live; LoRA leaves them frozen unless named."""
    vision_parts = {
        "vision_tower": ("visual.patch_embed.", "visual.pos_embed.", "visual.blocks."),
        "projector": ("visual.merger.", "visual.deepstack_merger_list."),
    }
    """The module prefixes of the parts ``model.vision_tower`` and ``model.projector`` set."""

    @property
    def pixel_token_ids(self) -> tuple[int, ...]:
        """The tokens the forward fills with the tower's features (images', videos').

        Text never holds them: generation does not sample them (``ModelRolloutEngine``).
        """
        vision = self.args.vision
        return (vision.image_token_id, vision.video_token_id)

    def __init__(self, args: ModelArgs) -> None:
        if args.vision is None:
            raise ValueError("a vision-language model needs args.vision")
        super().__init__(args)
        self.build_vision(args)

    def build_vision(self, args: ModelArgs) -> None:
        """Add the vision tower and projector (here ``visual``, the Qwen towers)."""
        if args.mrope_section is None:
            raise ValueError("a Qwen vision-language model needs args.mrope_section")
        tower = {"qwen2_5_vl": VisionTransformer, "qwen3_vl": Qwen3VisionTransformer}
        self.visual = tower[args.vision.layout](args.vision)

    def peft_target_name(self, module: str) -> str:
        """How ``adapter_config.json``'s ``target_modules`` names an adapted module.

        A path suffix valid both here and in transformers' model (see
        ``tunelab.peft.peft_target_modules``): the native path without ``model.``
        (``layers.0.self_attn.q_proj``, ``visual.merger.mlp.0``).
        """
        return module.removeprefix("model.")

    def peft_module_path(self, native_key: str) -> str:
        """Where a parameter lives in transformers' model, as a PEFT adapter names it.

        Checkpoint files keep the hub's keys (``model.layers.0...``, ``visual...``), but
        transformers (4.52 on, and 5) holds the language model under ``model.language_model``
        and the tower under ``model.visual``, and PEFT names adapter weights by those modules.
        """
        if native_key.startswith(self.vision_prefix):
            return "model." + native_key
        if native_key.startswith("model."):
            return "model.language_model." + native_key.removeprefix("model.")
        return native_key

    def peft_modules_to_save(self) -> list[str]:
        """The heads, plus the tower's modules a LoRA run trains whole (``full``).

        ``model.vision_tower: full`` / ``model.projector: full`` leave a part's weights
        trainable beside the adapters: each of its modules whose weights all train is named
        (native names; PEFT matches ``modules_to_save`` by suffix, so ``visual.blocks.0`` is
        transformers' ``model.visual.blocks.0``). Blocks are named one by one: PEFT wraps
        each named module, and the tower iterates its block list, which a wrapper would hide.
        """
        modules = {clean_fqn(name): module for name, module in self.named_modules()}
        whole = super().peft_modules_to_save()
        for prefixes in self.vision_parts.values():
            for prefix in prefixes:
                module = modules.get(prefix.removesuffix("."))
                if module is None:  # a part this tower lacks (Qwen2.5-VL's position table)
                    continue
                units = (
                    [(f"{prefix}{name}", child) for name, child in module.named_children()]
                    if isinstance(module, nn.ModuleList)
                    else [(prefix.removesuffix("."), module)]
                )
                for name, unit in units:
                    params = list(unit.parameters())
                    if params and all(param.requires_grad for param in params):
                        whole.append(name)
        return whole

    def _refuse_unsupported(
        self,
        tokens: torch.Tensor,
        unsupported: dict[str, object],
        document_ids: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> None:
        """Refuse what a vision-language forward does not take.

        Other decoder arguments (masks, context parallelism, shared prefixes), tokens that are
        not ``[batch, seq]``, and with KV caches ``document_ids`` or no ``input_pos``.
        """
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise ValueError(f"a vision-language forward does not support {given} yet")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if self.caches_are_enabled() and (document_ids is not None or input_pos is None):
            raise ValueError(
                "with KV caches a vision-language forward takes input_pos (the cache slots) "
                "and no document_ids"
            )

    def _start_of_prompts(self, input_pos: torch.Tensor) -> None:
        """Refuse a cached forward with images that does not start its rows at slot 0."""
        if not bool((input_pos[:, 0] == 0).all()):
            raise ValueError("with KV caches, images come in the prefill: rows starting at slot 0")

    def video_spans(
        self, video_grid_thw: torch.Tensor | None, second_per_grid_ts: torch.Tensor | None = None
    ) -> VideoSpans | None:
        """The runs of video tokens of a batch's videos, as this family lays them out.

        Qwen2.5-VL: one run per video, its frame pairs ``tokens_per_second *
        second_per_grid_ts`` positions apart (1 second a pair when not given, as transformers).
        Qwen3-VL: its processor writes each pair's timestamp before it, so each pair is a run
        positioned as a one-frame image.

        Args:
            video_grid_thw: long ``[videos, 3]``; None for no videos.
            second_per_grid_ts: ``[videos]`` seconds per frame pair (Qwen2.5-VL).
        """
        if video_grid_thw is None:
            return None
        vision = self.args.vision
        if vision.layout == "qwen3_vl":
            grids = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
            grids[:, 0] = 1
            return VideoSpans(vision.video_token_id, grids)
        seconds = (
            torch.ones(video_grid_thw.shape[0])
            if second_per_grid_ts is None
            else torch.as_tensor(second_per_grid_ts, dtype=torch.float32).cpu()
        )
        return VideoSpans(vision.video_token_id, video_grid_thw, vision.tokens_per_second * seconds)

    def _cached_positions(
        self,
        tokens: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        input_pos: torch.Tensor,
        videos: VideoSpans | None = None,
    ) -> torch.Tensor:
        """M-RoPE positions ``[3, batch, seq]`` of a forward with KV caches (generation).

        A forward with images or videos is a prefill (the prompts from slot 0): the positions
        are the training forward's, and each row's offset between slot and position after its
        prompt (``max position + 1 - seq``, transformers' ``rope_deltas``; 0 for a text row)
        goes in the caches (``KVCache.position_offsets``, which follow the rows the engine
        keeps). Any other cached forward (the decode steps) sits at its slots plus that
        offset, on all three axes.
        """
        vision = self.args.vision
        caches = [attention.kv_cache for attention in self._attentions()]
        if image_grid_thw is not None or videos is not None:
            self._start_of_prompts(input_pos)
            positions = multimodal_positions(
                tokens,
                image_grid_thw,
                vision.image_token_id,
                vision.spatial_merge_size,
                videos=videos,
            )
            offsets = positions.amax(dim=(0, 2)) + 1 - tokens.shape[1]
            for cache in caches:
                cache.position_offsets = offsets
            return positions
        offsets = caches[0].position_offsets
        flat = input_pos if offsets is None else input_pos + offsets[:, None]
        return flat[None].expand(3, *flat.shape)

    def _visual(
        self,
        h: torch.Tensor,
        tokens: torch.Tensor,
        token_id: int,
        pixels: torch.Tensor | None,
        grid_thw: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``h`` with the tower's embeddings of ``pixels`` in the ``token_id`` tokens.

        Returns:
            ``(h, mask, deepstack)``: the embeddings, where the tokens are, and their
            deepstack features (empty without pixels).
        """
        mask = tokens == token_id
        name = "image" if token_id == self.args.vision.image_token_id else "video"
        if pixels is None:
            if bool(mask.any()):
                given = "pixel_values" if name == "image" else "pixel_values_videos"
                raise ValueError(
                    f"the tokens hold {name} tokens but no {given} were given (a batch "
                    "collated without them: use tunelab.data.sft_collate)"
                )
            return h, mask, []
        features, deepstack = self.visual(pixels, grid_thw)
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} {name} tokens but the {name}s give {features.shape[0]} "
                "embeddings"
            )
        return h.masked_scatter(mask[..., None], features.to(h.dtype)), mask, deepstack

    def embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Token embeddings with each image's and video's embeddings in their tokens.

        Args:
            tokens: long ``[batch, seq]``.
            pixel_values: ``[patches, patch_features]`` of the batch's images, in order.
            image_grid_thw: long ``[images, 3]``.
            pixel_values_videos: ``[patches, patch_features]`` of the batch's videos, in order.
            video_grid_thw: long ``[videos, 3]``.

        Returns:
            ``([batch, seq, dim], deepstack)``: the embeddings, and the tower's deepstack
            features (``[image and video tokens, dim]`` each, in sequence order, for the first
            layers; Qwen3-VL) or ``[]``.

        Raises:
            ValueError: the image or video tokens do not match the pixels' sizes.
        """
        vision = self.args.vision
        h = self.model.embed_tokens(tokens)
        h, is_image, image_deep = self._visual(
            h, tokens, vision.image_token_id, pixel_values, image_grid_thw
        )
        h, is_video, video_deep = self._visual(
            h, tokens, vision.video_token_id, pixel_values_videos, video_grid_thw
        )
        if not (image_deep and video_deep):
            return h, image_deep or video_deep
        # Both: each layer's features over the visual tokens in sequence order.
        visual = is_image | is_video
        image_at, video_at = is_image[visual], is_video[visual]
        joint = []
        for image_part, video_part in zip(image_deep, video_deep, strict=True):
            merged = image_part.new_zeros(int(visual.sum()), image_part.shape[-1])
            merged[image_at] = image_part
            merged[video_at] = video_part.to(merged.dtype)
            joint.append(merged)
        return h, joint

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        return_hidden: bool = False,
        rows: torch.Tensor | None = None,
        **unsupported: object,
    ) -> torch.Tensor:
        """Compute next-token logits of rows that may hold images and videos.

        Args:
            tokens: long ``[batch, seq]``; an image is ``t * h * w / merge_unit`` consecutive
                image tokens (the image processor gives the count), a video likewise in video
                tokens (Qwen3-VL: ``h * w / merge_unit`` per frame pair, text between pairs).
            pixel_values: ``[patches, patch_features]`` of the batch's images, row after row.
            image_grid_thw: long ``[images, 3]`` of those images.
            pixel_values_videos: ``[patches, patch_features]`` of the batch's videos.
            video_grid_thw: long ``[videos, 3]`` of those videos (frame pairs, rows, columns).
            second_per_grid_ts: ``[videos]`` seconds per frame pair (Qwen2.5-VL's temporal
                positions; None: 1); Qwen3-VL ignores it (its timestamps are in the text).
            document_ids: ``[batch, seq]`` of packed rows (see ``TransformerDecoder``); an
                image lies inside one document.
            positions: long ``[3, batch, seq]`` M-RoPE positions; None computes them
                (``multimodal_positions``).
            input_pos: 1D positions ``[batch, seq]`` of rows without images (a text batch),
                the same on all three axes; ignored when the batch holds images. With KV
                caches (generation) they are the cache slots, required: a forward with images
                is the prefill, from slot 0, and later ones add each row's offset between slot
                and M-RoPE position, as transformers' generation does (``_cached_positions``).
            return_hidden: return the final normed hidden states instead of the logits.
            rows: the positions of ``[batch * seq]`` whose output is wanted: the last layer
                computes everything after its attention at these only (see
                ``TransformerDecoder.forward``).
            **unsupported: other ``TransformerDecoder.forward`` arguments (masks, context
                parallelism, shared prefixes) are refused.

        Returns:
            Logits ``[batch, seq, vocab_size]`` (hidden states with ``return_hidden``);
            ``[rows, ...]`` with ``rows``.

        Raises:
            ValueError: unsupported arguments, or image or video tokens that do not match
                the pixels.
        """
        self._refuse_unsupported(tokens, unsupported, document_ids, input_pos)
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw go together")
        if (pixel_values_videos is None) != (video_grid_thw is None):
            raise ValueError("pixel_values_videos and video_grid_thw go together")
        vision = self.args.vision
        videos = self.video_spans(video_grid_thw, second_per_grid_ts)
        cached = self.caches_are_enabled()
        if cached and positions is None:
            positions = self._cached_positions(tokens, image_grid_thw, input_pos, videos)
        has_pixels = pixel_values is not None or videos is not None
        if positions is None and input_pos is not None and not has_pixels:
            positions = input_pos[None].expand(3, *input_pos.shape)
        if positions is None:
            positions = multimodal_positions(
                tokens,
                image_grid_thw,
                vision.image_token_id,
                vision.spatial_merge_size,
                document_ids,
                videos,
            )
        h, deepstack = self.embed(
            tokens, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
        if cached:  # dense masks over the cache's slots (a query sees those up to its own)
            masks = self._layer_masks(None, input_pos, tokens.shape[1])
        else:
            masks = self._described_masks(tokens, document_ids)
        inv_freq = self.model.rotary_emb._frequencies(tokens.device)
        cos, sin = multimodal_rotary(
            inv_freq, positions, self.args.mrope_section, h.dtype, self.args.mrope_interleaved
        )
        is_visual = tokens == vision.image_token_id
        if pixel_values_videos is not None:
            is_visual = is_visual | (tokens == vision.video_token_id)
        visual_index = is_visual.reshape(-1).nonzero().squeeze(-1) if deepstack else None
        for index, layer in enumerate(self.model.layers):
            last = self.last_layer_rows(index, rows)
            h = layer(h, cos, sin, masks[FULL], input_pos, **last)
            if index < len(deepstack):
                # Deepstack: the k-th feature is added at the visual tokens after layer k.
                h = _add_deepstack(h, is_visual, visual_index, deepstack[index], last.get("rows"))
        h = self.model.norm(h)
        return h if return_hidden else self.output(h)
