"""Gemma 3's multimodal decoder: SigLIP soft tokens in a Gemma 3 language model.

HF's ``Gemma3ForConditionalGeneration``. The language model is tunelab's Gemma 3 decoder
(embeddings scaled by ``sqrt(dim)``, sliding-window and global layers with their own rotary
bases); what differs is its input and its mask:

* each image (``[3, image_size, image_size]`` pixels) becomes ``tokens_per_image`` soft tokens
  (``tunelab.modules.vision_siglip``), which replace the scaled embeddings of that image's
  ``image_token_id`` tokens, image after image (the processor writes them between ``boi`` and
  ``eoi`` tokens);
* the tokens of one image (a run of image tokens) attend to each other bidirectionally. A
  global layer lets query ``q`` see key ``k`` when ``k <= q`` or both lie in the same image; a
  sliding-window layer when, in addition, ``q - k < sliding_window``: ``window AND (causal OR
  same image)``, transformers' ``create_masks_for_vision_model``. Each query still sees one
  interval of keys, so the masks stay ``AttentionMask`` descriptions (``last_keys``).

Positions are 1D (``0..seq-1``, restarting per packed document), as for text.
"""

import torch

from tunelab.models.args import ModelArgs
from tunelab.models.vision_language import VisionLanguageDecoder
from tunelab.modules.masks import image_block_ends, positions_from_document_ids
from tunelab.modules.vision_siglip import Gemma3Projector, SiglipVisionTower


class Gemma3VisionLanguageDecoder(VisionLanguageDecoder):
    """``TransformerDecoder`` plus SigLIP and its projector (``Gemma3ForConditionalGeneration``).

    Args:
        args: the model's arguments, ``args.vision`` with layout ``gemma3``.
    """

    vision_prefix = ("vision_tower.", "multi_modal_projector.")
    """Where the vision tower and projector live; LoRA leaves them frozen unless named."""
    vision_parts = {
        "vision_tower": (
            "vision_tower.embeddings.",
            "vision_tower.encoder.layers.",
            "vision_tower.post_layernorm.",
        ),
        "projector": ("multi_modal_projector.",),
    }
    """The module prefixes of the parts ``model.vision_tower`` and ``model.projector`` set."""

    @property
    def pixel_token_ids(self) -> tuple[int, ...]:
        """Gemma 3 has images only (its ``video_token_id`` default is a text token there)."""
        return (self.args.vision.image_token_id,)

    def build_vision(self, args: ModelArgs) -> None:
        """Add SigLIP (``vision_tower``) and the projector (``multi_modal_projector``)."""
        if args.vision.layout != "gemma3":
            raise ValueError(
                f"a Gemma 3 tower needs vision layout gemma3, not {args.vision.layout}"
            )
        self.vision_tower = SiglipVisionTower(args.vision)
        self.multi_modal_projector = Gemma3Projector(args.vision)

    def peft_target_name(self, module: str) -> str:
        """The module's path in transformers without ``model.``.

        ``language_model.layers.0.self_attn.q_proj``, ``vision_tower.encoder.layers.0.mlp.fc1``:
        SigLIP's blocks have ``layers.N.self_attn.q_proj`` too, so a shorter suffix would have
        PEFT adapt them as well.
        """
        return self.peft_module_path(module).removeprefix("model.")

    def embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Scaled token embeddings with each image's soft tokens in its image tokens.

        Args:
            tokens: long ``[batch, seq]``.
            pixel_values: ``[images, 3, image_size, image_size]`` of the batch's images (and
                pan-and-scan crops), in order.
            image_grid_thw: ignored (the tokens per image are fixed); see ``forward``.

        Returns:
            ``([batch, seq, dim], [])``.

        Raises:
            ValueError: the image tokens do not match the images.
        """
        vision = self.args.vision
        is_image = tokens == vision.image_token_id
        # An image token outside the vocabulary reads row 0 before it is replaced (as HF does).
        ids = (
            tokens.masked_fill(is_image, 0)
            if vision.image_token_id >= self.args.vocab_size
            else tokens
        )
        h = self.model.embed_tokens(ids)
        h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype, device=h.device)
        if pixel_values is None:
            if bool(is_image.any()):
                raise ValueError(
                    "the tokens hold image tokens but no pixel_values were given (a batch "
                    "collated without its images: use tunelab.data.sft_collate)"
                )
            return h, []
        images = self.multi_modal_projector(self.vision_tower(pixel_values))
        images = images.reshape(-1, images.shape[-1])
        if int(is_image.sum()) != images.shape[0]:
            raise ValueError(
                f"{int(is_image.sum())} image tokens but the {pixel_values.shape[0]} images give "
                f"{images.shape[0]} soft tokens ({vision.tokens_per_image} each)"
            )
        return h.masked_scatter(is_image[..., None], images.to(h.dtype)), []

    def _cached_masks(
        self, input_pos: torch.Tensor, last_keys: torch.Tensor | None
    ) -> dict[str, torch.Tensor | None]:
        """Dense masks over the KV cache's slots (generation), each attention kind's.

        A query sees the slots up to its own, or up to its image's last one (``last_keys``:
        the prefill of a prompt with images, from slot 0); a sliding-window layer cuts that to
        its window, as without a cache.
        """
        mask = None
        if last_keys is not None:
            self._start_of_prompts(input_pos)
            cache_len = next(self._attentions()).kv_cache.max_seq_len
            slots = torch.arange(cache_len, device=input_pos.device)
            mask = slots[None, None, :] <= input_pos.gather(1, last_keys)[:, :, None]
        return self._layer_masks(mask, input_pos, input_pos.shape[1])

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        return_hidden: bool = False,
        rows: torch.Tensor | None = None,
        **unsupported: object,
    ) -> torch.Tensor:
        """Compute next-token logits of rows that may hold images.

        Args:
            tokens: long ``[batch, seq]``; an image is ``tokens_per_image`` consecutive image
                tokens (between the processor's ``boi`` and ``eoi``).
            pixel_values: ``[images, 3, image_size, image_size]``, row after row.
            image_grid_thw: long ``[images, 3]`` as the collate gives it (pieces, patch rows,
                patch columns of each image file: pan-and-scan crops count as pieces); its
                pieces must add up to ``pixel_values``' images.
            document_ids: ``[batch, seq]`` of packed rows (see ``TransformerDecoder``); an
                image lies inside one document.
            input_pos: positions ``[batch, seq]``; None: ``0..seq-1`` (per document). With
                KV caches (generation) they are the cache slots, required, and a forward with
                images is the prefill (rows from slot 0; each image's tokens see each other).
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
            ValueError: unsupported arguments, or image tokens that do not match the images.
        """
        self._refuse_unsupported(tokens, unsupported, document_ids, input_pos)
        if image_grid_thw is not None and pixel_values is not None:
            pieces = int(image_grid_thw[:, 0].sum())
            if pieces != pixel_values.shape[0]:
                raise ValueError(
                    f"image_grid_thw lists {pieces} image pieces but pixel_values holds "
                    f"{pixel_values.shape[0]}"
                )
        batch, seq_len = tokens.shape
        if input_pos is None:
            input_pos = (
                torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
                if document_ids is None
                else positions_from_document_ids(document_ids)
            )
        h, _ = self.embed(tokens, pixel_values)
        is_image = tokens == self.args.vision.image_token_id
        last_keys = image_block_ends(is_image) if bool(is_image.any()) else None
        if self.caches_are_enabled():
            masks = self._cached_masks(input_pos, last_keys)
        else:
            masks = self._described_masks(tokens, document_ids, last_keys=last_keys)
        rotary = self._rotary_tables(input_pos, h.dtype)
        for index, layer in enumerate(self.model.layers):
            kind = self.args.layer_type(index)
            cos, sin = rotary[kind]
            h = layer(h, cos, sin, masks[kind], input_pos, **self.last_layer_rows(index, rows))
        h = self.model.norm(h)
        return h if return_hidden else self.output(h)
