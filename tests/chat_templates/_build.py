"""Tokenizer folders carrying a chat template, built offline for chat-template tests.

Each ``TemplateSpec`` names a template (a real one from this folder, or one written here) and the
special tokens it needs. ``make_tokenizer_dir`` trains a small byte-level BPE (Llama 3's split
pattern) on a fixed corpus with ``tokenizers``, adds those special tokens, and writes
``tokenizer.json``, ``tokenizer_config.json`` (with the template) and ``generation_config.json``.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "You are a helpful assistant. Be brief.",
    "Sort the letters: d a c. a c d",
    "Reverse the words: red cat sun. sun cat red",
    "Next number after 41: 42. Count the words: one two three. 3",
    "What is the weather in Paris today? It is sunny and 22 degrees.",
    '{"name": "get_weather", "parameters": {"location": "Paris"}, "arguments": {}}',
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "<think>\nThe user wants the letters sorted.\n</think>\n\n",
    "### Instruction:\n### Response:\n### Input:\n",
    "unicode: héllo ☃ 日本語 🙂 and tabs\tand  spaces\n\n\n",
]

# Role and format markers of the templates written below.
LLAMA3_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PHI3_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|endoftext|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
    "<|user|>",
]
MISTRAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]

# Gemma-like: no system role (raises on one), strict alternation, "model" for the assistant.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Llama 2-like: the system prompt merged into the first user turn; raises on bad role order;
# no generation prompt of its own (the reply follows " [/INST]").
SYSTEM_MERGED_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
# ChatML whose assistant content and <|im_end|> are wrapped in a generation block.
GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-like reasoning: an assistant turn after the last user message keeps its <think> block,
# earlier ones lose it; enable_thinking=false prefills an empty one.
REASONING_TEMPLATE = """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


@dataclass(frozen=True)
class TemplateSpec:
    """A chat template and the tokenizer it needs."""

    name: str
    template: str
    special_tokens: list[str]
    bos: str | None
    eos: str
    pad: str | None = None
    # Ids generation stops at besides EOS (as a real generation_config.json lists them).
    stop_tokens: list[str] = field(default_factory=list)
    # Added tokens that are not special (Qwen's <tool_call>, the <think> markers).
    plain_tokens: list[str] = field(default_factory=list)


def _read(name: str) -> str:
    return (HERE / name).read_text(encoding="utf-8")


SPECS = {
    spec.name: spec
    for spec in [
        TemplateSpec(
            "llama3_2",
            _read("llama3_2_instruct.jinja"),
            LLAMA3_TOKENS,
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
        ),
        TemplateSpec(
            "qwen2_5",
            _read("qwen2_5_instruct.jinja"),
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            plain_tokens=["<tool_call>", "</tool_call>"],
        ),
        TemplateSpec(
            "mistral_nemo",
            _read("mistral_nemo_instruct.jinja"),
            MISTRAL_TOKENS,
            bos="<s>",
            eos="</s>",
        ),
        TemplateSpec(
            "llama3_1",
            _read("llama3_1_instruct.jinja"),
            LLAMA3_TOKENS,
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
        ),
        TemplateSpec(
            "qwen3",
            _read("qwen3.jinja"),
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            plain_tokens=[
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
                "<think>",
                "</think>",
            ],
        ),
        TemplateSpec(
            "qwen2_5_training",
            _read("qwen2_5_training.jinja"),
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            plain_tokens=["<tool_call>", "</tool_call>"],
        ),
        TemplateSpec(
            "qwen3_training",
            _read("qwen3_training.jinja"),
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            plain_tokens=[
                "<tool_call>",
                "</tool_call>",
                "<tool_response>",
                "</tool_response>",
                "<think>",
                "</think>",
            ],
        ),
        TemplateSpec(
            "phi3_5",
            _read("phi3_5_mini_instruct.jinja"),
            PHI3_TOKENS,
            bos="<s>",
            eos="<|endoftext|>",
            # Phi-3.5-mini's generation_config.json: eos_token_id [32007, 32001, 32000].
            stop_tokens=["<|end|>", "<|assistant|>"],
        ),
        TemplateSpec(
            "no_system",
            NO_SYSTEM_TEMPLATE,
            ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
            bos="<bos>",
            eos="<eos>",
            pad="<pad>",
            stop_tokens=["<end_of_turn>"],
        ),
        TemplateSpec(
            "system_merged",
            SYSTEM_MERGED_TEMPLATE,
            ["<unk>", "<s>", "</s>"],
            bos="<s>",
            eos="</s>",
        ),
        TemplateSpec(
            "generation",
            GENERATION_TEMPLATE,
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
        ),
        TemplateSpec(
            "reasoning",
            REASONING_TEMPLATE,
            QWEN_TOKENS,
            bos=None,
            eos="<|im_end|>",
            plain_tokens=["<think>", "</think>"],
        ),
    ]
}


def _train(spec: TemplateSpec) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=spec.special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_tokens(spec.plain_tokens)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def make_tokenizer_dir(
    path: Path,
    spec: TemplateSpec,
    *,
    chat_template: object = "inline",
) -> Path:
    """Write a tokenizer folder for ``spec`` into ``path`` and return it.

    Args:
        path: The folder (created).
        spec: The template and its tokens.
        chat_template: ``"inline"`` puts the template in ``tokenizer_config.json``; ``"file"``
            writes ``chat_template.jinja``; ``None`` writes none; any other value is written to
            the config's ``chat_template`` as is (e.g. a list of named templates).
    """
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(spec)
    tokenizer.save(str(path / "tokenizer.json"))
    added = {}
    for token in spec.special_tokens + spec.plain_tokens:
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in spec.special_tokens,
        }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    if chat_template == "inline":
        config["chat_template"] = spec.template
    elif chat_template == "file":
        (path / "chat_template.jinja").write_text(spec.template, encoding="utf-8")
    elif chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    stop_ids = [tokenizer.token_to_id(t) for t in [spec.eos, *spec.stop_tokens]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_ids}))
    return path
