"""Data: from dataset files to batches, one module per stage.

1. Read rows: ``sources`` (local files or the hub; JSON read as written, ``file:line`` errors).
2. Render and tokenize a row: ``rows`` (column layouts, typed reads, each builder's row
   function), with ``templates`` (named formats), ``chat_template`` (a tokenizer's Jinja
   template, sandboxed: ``_jinja_env``, ``_render_budget``), ``chat`` (conversation to ids and
   masks) and ``tokenizer``.
3. Tokenize a whole source, once per machine and cached: ``cache``.
4. Open the result as a dataset: ``tokenized`` (``TokenizedDataset``), built by ``sft``,
   ``preference`` and ``prompts``; ``mix`` weights several.
5. Pack: ``packing``. 6. Collate: ``collate``. 7. Sample over ranks, resumably: ``sampler``.

With ``streaming: true``, stages 3 to 5 run on the fly instead (``streaming``) and the global
batches are split over ranks with a saved stream position (``stream_loader``).
"""

from tunelab.data.chat import apply_chat_template, tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.collate import padded_collate_dpo, padded_collate_kto, padded_collate_sft
from tunelab.data.image_dataset import image_chat_dataset, sft_collate
from tunelab.data.image_preference import image_preference_dataset, preference_collate
from tunelab.data.mix import DatasetSpec, MixedDataset, mix_dataset
from tunelab.data.packing import pack_samples
from tunelab.data.preference import preference_dataset
from tunelab.data.prompts import PromptDataset, padded_collate_prompts, prompt_dataset
from tunelab.data.rows import IGNORE_INDEX
from tunelab.data.sampler import StatefulDistributedSampler
from tunelab.data.sft import chat_dataset, instruct_dataset, text_dataset
from tunelab.data.templates import TEMPLATES, Message, Template, get_template, tokenize_messages
from tunelab.data.tokenized import TokenizedDataset
from tunelab.data.tokenizer import Tokenizer, load_tokenizer
from tunelab.data.unpaired import kto_dataset

__all__ = [
    "IGNORE_INDEX",
    "TEMPLATES",
    "ChatTemplate",
    "ChatTemplateError",
    "DatasetSpec",
    "Message",
    "MixedDataset",
    "PromptDataset",
    "StatefulDistributedSampler",
    "Template",
    "TokenizedDataset",
    "Tokenizer",
    "apply_chat_template",
    "chat_dataset",
    "image_chat_dataset",
    "image_preference_dataset",
    "get_template",
    "instruct_dataset",
    "load_tokenizer",
    "mix_dataset",
    "pack_samples",
    "padded_collate_dpo",
    "padded_collate_kto",
    "padded_collate_prompts",
    "padded_collate_sft",
    "preference_collate",
    "sft_collate",
    "preference_dataset",
    "kto_dataset",
    "prompt_dataset",
    "text_dataset",
    "tokenize_conversation",
    "tokenize_messages",
]
