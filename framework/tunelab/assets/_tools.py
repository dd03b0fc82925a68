"""Tool-calling conversations over the tiny tasks, and a ChatML tool template to render them.

Each of the four tiny rules becomes a tool (``reverse_words``, ``sort_letters``,
``next_number``, ``count_words``). A row asks for one or two tasks; the assistant calls the
tools (two in parallel for two tasks), possibly after a line of reasoning, the tool messages
give the results, and the assistant answers with them. ``tools_chat_template.jinja`` renders
the tools in the system turn (compactly, ``name(argument)``: the tiny model reads 512 tokens), calls as ``<tool_call>{...}</tool_call>``, results as ``tool``
turns and reasoning as a ``<think>`` block, with the tiny tokenizer's ChatML tokens; it renders
every turn the same way whatever follows it, so a conversation is one sample.
"""

import json
import random

from tunelab.assets import _tasks

# Tool name, its argument, and how an example's input becomes the argument's value.
_TOOLS = {
    "Reverse the words": ("reverse_words", "words", "The words in reverse order."),
    "Sort the letters": ("sort_letters", "letters", "The letters in alphabetical order."),
    "Next number after": ("next_number", "number", "The number after the given one."),
    "Count the words": ("count_words", "text", "How many words the text has."),
}
TOOL_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "integer" if argument == "number" else "string"}},
                "required": [argument],
            },
        },
    }
    for name, argument, description in _TOOLS.values()
]

TOOLS_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n' + (system + '\\n\\n' if system else '') + 'Tools:' }}
    {%- for tool in tools %}
        {%- set arguments = tool.function.parameters.properties | list | join(', ') %}
        {{- ' ' + tool.function.name + '(' + arguments + ')' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif system %}
    {{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _call(example: _tasks.Example, index: int) -> tuple[dict, str]:
    """The tool call that answers ``example`` (as a row writes it: arguments as JSON text)."""
    prefix = example.prompt.split(":")[0]
    name, argument, _ = _TOOLS[prefix]
    value: object = example.input
    if argument == "number":
        value = int(example.output) - 1
    call = {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({argument: value})},
    }
    return call, name


def tool_rows(rng: random.Random, count: int) -> list[dict]:
    """``count`` rows of ``{"tools", "messages"}``: one or two tasks answered through tools."""
    rows = []
    for _ in range(count):
        examples = _tasks.make_examples(rng, rng.randint(1, 2), distinct=False)
        messages = (
            [{"role": "system", "content": _tasks.SYSTEM_PROMPT}] if rng.random() < 0.3 else []
        )
        messages.append({"role": "user", "content": ". ".join(e.prompt for e in examples)})
        calls = [_call(example, i) for i, example in enumerate(examples)]
        turn = {"role": "assistant", "content": None, "tool_calls": [call for call, _ in calls]}
        if rng.random() < 0.5:
            turn["reasoning_content"] = "Call " + " and ".join(name for _, name in calls) + "."
        messages.append(turn)
        for (call, name), example in zip(calls, examples):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": name,
                    "content": example.output,
                }
            )
        messages.append({"role": "assistant", "content": "\n".join(e.output for e in examples)})
        rows.append({"tools": TOOL_SCHEMAS, "messages": messages})
    return rows


def calculator_rows(
    rng: random.Random, count: int, low: int = 10, high: int = 89
) -> tuple[list[dict], list[dict]]:
    """Additions, half answered through ``tunelab.rl.agentic.calculator`` (tiny/agentic_*).

    Each conversation asks ``What is a + b?`` (two numbers from ``low`` to ``high``: every
    number the task writes is one tiny token), rendered as agentic GRPO renders its episodes
    (no system turn, no reasoning). Half of them call the calculator with the expression, read
    its result and answer with it; the other half answer at once. A model fine-tuned on them
    calls the tool about half the time, and cannot add on its own: agentic GRPO's reward then
    teaches it to call.

    Args:
        rng: The random source (conversations first, then prompts).
        count: Conversations, and prompts, to make.
        low: The smallest number added.
        high: The largest number added.

    Returns:
        ``count`` SFT rows of ``{"tools", "messages"}`` and ``count`` GRPO prompts of
        ``{"prompt", "answer"}`` (other numbers from the same source).
    """
    from transformers.utils import get_json_schema

    from tunelab.rl.agentic import calculator

    tools = [get_json_schema(calculator)]

    def addition() -> tuple[str, str, str]:
        a, b = rng.randint(low, high), rng.randint(low, high)
        return f"What is {a} + {b}?", f"{a} + {b}", str(a + b)

    conversations = []
    for number in range(count):
        prompt, expression, answer = addition()
        messages: list[dict] = [{"role": "user", "content": prompt}]
        if number % 2 == 0:
            call = {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}},
            }
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": answer},
            ]
        messages.append({"role": "assistant", "content": answer})
        conversations.append({"tools": tools, "messages": messages})
    prompts = []
    for _ in range(count):
        prompt, _, answer = addition()
        prompts.append({"prompt": prompt, "answer": answer})
    return conversations, prompts
