"""A decoder that reads images: Qwen2.5-VL's or Qwen3-VL's vision tower, image tokens, M-RoPE.

The language model is tunelab's ``TransformerDecoder`` unchanged; what differs is its input:

* each image's embeddings (``tunelab.modules.vision.VisionTransformer``) replace the
  embeddings of that image's ``image_token_id`` tokens, image after image;
* rotary positions are 3D (multimodal RoPE, M-RoPE; Qwen2-VL, Wang et al., 2024,
  https://arxiv.org/abs/2409.12191): a text token has the same position ``p`` on all three
  axes; an image's tokens, a grid of ``t x h x w``, have ``(s + frame, s + row, s + column)``
  with ``s`` the position after the text before it, and the text after the image resumes at
  ``s + max(h, w)``. Rotary frequency ``i`` of a head follows the temporal, height or width
  position depending on which of the ``mrope_section`` sizes it falls in.

Parameter names are the hub checkpoints' (``visual.*``, ``model.*``, ``lm_head.weight``).
"""

import numpy as np
import torch
from torch import nn

from tunelab.distributed._fqn import clean_fqn
from tunelab.models.args import FULL, ModelArgs
from tunelab.models.decoder import TransformerDecoder
from tunelab.modules.masks import positions_from_document_ids
from tunelab.modules.vision import VisionTransformer
from tunelab.modules.vision_qwen3 import Qwen3VisionTransformer


def multimodal_positions(
    tokens: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    merge_size: int,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """M-RoPE positions of a batch, images in the order the rows hold them.

    Args:
        tokens: long ``[batch, seq]``.
        image_grid_thw: long ``[images, 3]`` (frames, patch rows, patch columns) of every
            image in the batch, row after row; None for text only.
        image_token_id: the token an image's embeddings replace.
        merge_size: the vision tower's ``spatial_merge_size``.
        document_ids: ``[batch, seq]`` of packed rows: positions restart at each document.

    Returns:
        Long ``[3, batch, seq]``: temporal, height and width positions.

    Raises:
        ValueError: the image tokens do not match the grids.
    """
    batch, seq_len = tokens.shape
    if image_grid_thw is None or not bool((tokens == image_token_id).any()):
        if document_ids is None:
            flat = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
        else:
            flat = positions_from_document_ids(document_ids)
        return flat[None].expand(3, batch, seq_len)
    grids = [tuple(grid) for grid in image_grid_thw.tolist()]
    next_grid = 0
    # Plain lists and numpy: a per-token loop over tensor elements cost ~10 ms a batch.
    positions = np.empty((3, batch, seq_len), dtype=np.int64)
    is_image = (tokens == image_token_id).cpu().tolist()
    if document_ids is None:
        starts = [[True] + [False] * (seq_len - 1) for _ in range(batch)]
    else:
        document_ids = document_ids.cpu()
        begins = torch.ones(batch, seq_len, dtype=torch.bool)
        begins[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        starts = begins.tolist()
    for row in range(batch):
        flags, begins_row = is_image[row], starts[row]
        index, current = 0, 0
        while index < seq_len:
            if begins_row[index]:
                current = 0
            if not flags[index]:
                # A text run: to the next image token or document start.
                end = index + 1
                while end < seq_len and not flags[end] and not begins_row[end]:
                    end += 1
                positions[:, row, index:end] = np.arange(current, current + end - index)
                current, index = current + end - index, end
                continue
            if next_grid >= len(grids):
                raise ValueError("more image tokens than image_grid_thw describes")
            frames, rows, columns = grids[next_grid]
            next_grid += 1
            rows, columns = rows // merge_size, columns // merge_size
            count = frames * rows * columns
            if index + count > seq_len or not all(flags[index : index + count]):
                raise ValueError(
                    f"row {row}: image {next_grid - 1} needs {count} consecutive image tokens "
                    f"at position {index}"
                )
            grid = np.indices((frames, rows, columns)).reshape(3, -1)
            positions[:, row, index : index + count] = grid + current
            current += max(rows, columns)
            index += count
    if next_grid != len(grids):
        raise ValueError(
            f"image_grid_thw describes {len(grids)} images but the tokens hold {next_grid}"
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

    def _cached_positions(
        self,
        tokens: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        """M-RoPE positions ``[3, batch, seq]`` of a forward with KV caches (generation).

        A forward with images is a prefill (the prompts from slot 0): the positions are the
        training forward's, and each row's offset between slot and position after its prompt
        (``max position + 1 - seq``, transformers' ``rope_deltas``; 0 for a text row) goes in
        the caches (``KVCache.position_offsets``, which follow the rows the engine keeps). Any
        other cached forward (the decode steps) sits at its slots plus that offset, on all
        three axes.
        """
        vision = self.args.vision
        caches = [attention.kv_cache for attention in self._attentions()]
        if image_grid_thw is not None:
            self._start_of_prompts(input_pos)
            positions = multimodal_positions(
                tokens, image_grid_thw, vision.image_token_id, vision.spatial_merge_size
            )
            offsets = positions.amax(dim=(0, 2)) + 1 - tokens.shape[1]
            for cache in caches:
                cache.position_offsets = offsets
            return positions
        offsets = caches[0].position_offsets
        flat = input_pos if offsets is None else input_pos + offsets[:, None]
        return flat[None].expand(3, *flat.shape)

    def embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Token embeddings with each image's embeddings in its image tokens.

        Args:
            tokens: long ``[batch, seq]``.
            pixel_values: ``[patches, patch_features]`` of the batch's images, in order.
            image_grid_thw: long ``[images, 3]``.

        Returns:
            ``([batch, seq, dim], deepstack)``: the embeddings, and the tower's deepstack
            features (``[image tokens, dim]`` each, for the first layers; Qwen3-VL) or ``[]``.

        Raises:
            ValueError: the image tokens do not match the images' sizes.
        """
        h = self.model.embed_tokens(tokens)
        if pixel_values is None:
            if bool((tokens == self.args.vision.image_token_id).any()):
                raise ValueError(
                    "the tokens hold image tokens but no pixel_values were given (a batch "
                    "collated without its images: use tunelab.data.sft_collate)"
                )
            return h, []
        images, deepstack = self.visual(pixel_values, image_grid_thw)
        is_image = tokens == self.args.vision.image_token_id
        if int(is_image.sum()) != images.shape[0]:
            raise ValueError(
                f"{int(is_image.sum())} image tokens but the images give {images.shape[0]} "
                "embeddings"
            )
        return h.masked_scatter(is_image[..., None], images.to(h.dtype)), deepstack

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        return_hidden: bool = False,
        **unsupported: object,
    ) -> torch.Tensor:
        """Compute next-token logits of rows that may hold images.

        Args:
            tokens: long ``[batch, seq]``; an image is ``t * h * w / merge_unit`` consecutive
                image tokens (the image processor gives the count).
            pixel_values: ``[patches, patch_features]`` of the batch's images, row after row.
            image_grid_thw: long ``[images, 3]`` of those images.
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
            **unsupported: other ``TransformerDecoder.forward`` arguments (masks, context
                parallelism, shared prefixes) are refused.

        Returns:
            Logits ``[batch, seq, vocab_size]`` (hidden states with ``return_hidden``).

        Raises:
            ValueError: unsupported arguments, or image tokens that do not match the images.
        """
        self._refuse_unsupported(tokens, unsupported, document_ids, input_pos)
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw go together")
        vision = self.args.vision
        cached = self.caches_are_enabled()
        if cached and positions is None:
            positions = self._cached_positions(tokens, image_grid_thw, input_pos)
        if positions is None and input_pos is not None and pixel_values is None:
            positions = input_pos[None].expand(3, *input_pos.shape)
        if positions is None:
            positions = multimodal_positions(
                tokens,
                image_grid_thw,
                vision.image_token_id,
                vision.spatial_merge_size,
                document_ids,
            )
        h, deepstack = self.embed(tokens, pixel_values, image_grid_thw)
        if cached:  # dense masks over the cache's slots (a query sees those up to its own)
            masks = self._layer_masks(None, input_pos, tokens.shape[1])
        else:
            masks = self._described_masks(tokens, document_ids)
        inv_freq = self.model.rotary_emb._frequencies(tokens.device)
        cos, sin = multimodal_rotary(
            inv_freq, positions, self.args.mrope_section, h.dtype, self.args.mrope_interleaved
        )
        is_image = tokens == vision.image_token_id
        for index, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, masks[FULL], input_pos)
            if index < len(deepstack):
                # Deepstack: the k-th feature is added at the image tokens after layer k.
                added = h[is_image] + deepstack[index].to(h.dtype)
                h = h.masked_scatter(is_image[..., None], added)
        h = self.model.norm(h)
        return h if return_hidden else self.output(h)
