"""Data: tokenizer, chat templates, SFT and preference datasets, mixing, packing, collate, sampler."""

from tunelab.data.chat import apply_chat_template, tokenize_conversation
from tunelab.data.chat_template import ChatTemplate, ChatTemplateError
from tunelab.data.collate import padded_collate_dpo, padded_collate_sft
from tunelab.data.mix import DatasetSpec, MixedDataset, mix_dataset
from tunelab.data.packing import pack_samples
from tunelab.data.preference import preference_dataset
from tunelab.data.prompts import PromptDataset, padded_collate_prompts, prompt_dataset
from tunelab.data.sampler import StatefulDistributedSampler
from tunelab.data.sft import chat_dataset, instruct_dataset, text_dataset
from tunelab.data.templates import TEMPLATES, Message, Template, get_template, tokenize_messages
from tunelab.data.tokenized import IGNORE_INDEX, TokenizedDataset
from tunelab.data.tokenizer import Tokenizer, load_tokenizer

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
    "get_template",
    "instruct_dataset",
    "load_tokenizer",
    "mix_dataset",
    "pack_samples",
    "padded_collate_dpo",
    "padded_collate_prompts",
    "padded_collate_sft",
    "preference_dataset",
    "prompt_dataset",
    "text_dataset",
    "tokenize_conversation",
    "tokenize_messages",
]
