"""The tiny tasks' tools as Python functions, for agentic GRPO on the tiny model.

Names and arguments are those of the embedded tool-call data (``tool_calls.jsonl``, rendered
by ``tools_chat_template.jinja``), so a tiny model fine-tuned on it (``tiny/chat_tools_lora``)
calls them as it learned to. Each tool is the task's rule: an episode that calls it and
answers with its result solves the task, which the tiny model cannot do on its own.
"""

__all__ = ["count_words", "next_number", "reverse_words", "sort_letters"]


def reverse_words(words: str) -> str:
    """The words in reverse order.

    Args:
        words: Words separated by spaces.
    """
    return " ".join(words.split()[::-1])


def sort_letters(letters: str) -> str:
    """The letters in alphabetical order.

    Args:
        letters: Letters separated by spaces.
    """
    return " ".join(sorted(letters.split()))


def next_number(number: int) -> str:
    """The number after the given one.

    Args:
        number: A whole number.
    """
    return str(number + 1)


def count_words(text: str) -> str:
    """How many words the text has.

    Args:
        text: The text.
    """
    return str(len(text.split()))
