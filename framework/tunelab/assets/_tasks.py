"""Generated toy tasks with a learnable rule, for the embedded tiny datasets.

Four rules a tiny model learns on a CPU in a minute or two: reverse a list of words, sort a
list of letters, name the number after a given one, count the words. Every example also has a
plausibly wrong answer (the input order unchanged, a near miss by one), which makes the
preference pairs. The generic pretraining text uses the same vocabulary and shows copying,
counting and alphabetical order, but never an instruction followed by its answer, so that the
rules themselves are left for fine-tuning to teach.
"""

import random
from dataclasses import dataclass

WORDS = (
    "red blue green black white cat dog fish bird cow sun moon star rain snow tree leaf rock "
    "sea hill book pen cup hat box car bus ship road door key map lamp bed milk bread egg "
    "apple cake ring bell"
).split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_NUMBER = 299
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class Example:
    """One task instance.

    Attributes:
        instruction: What to do, e.g. "Reverse the words.".
        input: The task's argument ("" when the instruction carries it).
        output: The correct answer.
        wrong: A plausible wrong answer (for preference pairs).
        prompt: Instruction and input as one chat line, e.g. "Reverse the words: red cat".
    """

    instruction: str
    input: str
    output: str
    wrong: str
    prompt: str


def _near_miss(rng: random.Random, items: list[str], correct: list[str]) -> list[str]:
    """Return a wrong ordering: the input unchanged or the correct one with two items swapped."""
    if items != correct and rng.random() < 0.5:
        return list(items)
    wrong = list(correct)
    i, j = rng.sample(range(len(wrong)), 2)
    wrong[i], wrong[j] = wrong[j], wrong[i]
    if wrong == correct:  # two equal items swapped: fall back to a rotation
        wrong = correct[1:] + correct[:1]
    return wrong


def _reverse(rng: random.Random) -> Example:
    words = rng.sample(WORDS, rng.randint(3, 5))
    correct = words[::-1]
    text = " ".join(words)
    return Example(
        "Reverse the words.",
        text,
        " ".join(correct),
        " ".join(_near_miss(rng, words, correct)),
        f"Reverse the words: {text}",
    )


def _sort(rng: random.Random) -> Example:
    letters = rng.sample(LETTERS, rng.randint(3, 6))
    while letters == sorted(letters):
        rng.shuffle(letters)
    correct = sorted(letters)
    text = " ".join(letters)
    return Example(
        "Sort the letters.",
        text,
        " ".join(correct),
        " ".join(_near_miss(rng, letters, correct)),
        f"Sort the letters: {text}",
    )


def next_number(rng: random.Random) -> Example:
    number = rng.randint(0, MAX_NUMBER - 1)
    wrong = rng.choice([number, number + 2, max(number - 1, 0) if number else number + 3])
    if rng.random() < 0.5:
        instruction, given = f"What number comes after {number}?", ""
    else:
        instruction, given = "Name the next number.", str(number)
    return Example(instruction, given, str(number + 1), str(wrong), f"Next number after {number}:")


def _count(rng: random.Random) -> Example:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 6))]
    text = " ".join(words)
    wrong = len(words) + rng.choice([-1, 1]) if len(words) > 1 else 2
    return Example(
        "Count the words.", text, str(len(words)), str(wrong), f"Count the words: {text}"
    )


TASKS = (_reverse, _sort, next_number, _count)


def make_examples(
    rng: random.Random,
    count: int,
    *,
    distinct: bool = True,
    exclude: set[str] | None = None,
    tasks: tuple = TASKS,
) -> list[Example]:
    """Draw ``count`` examples, cycling through the tasks.

    Args:
        rng: The seeded random source.
        count: How many examples to make.
        distinct: Whether no two examples may share instruction and input.
        exclude: ``instruction + input`` keys not to produce (keeps a validation split
            disjoint from training).
        tasks: The task functions to cycle through (default: all four).

    Returns:
        The examples, in generation order.
    """
    seen = set(exclude or ())
    examples: list[Example] = []
    while len(examples) < count:
        example = tasks[len(examples) % len(tasks)](rng)
        key = example_key(example)
        if distinct and key in seen:
            continue
        seen.add(key)
        examples.append(example)
    return examples


def example_key(example: Example) -> str:
    """Return the text that identifies an example's question (instruction and input)."""
    return f"{example.instruction}|{example.input}"


def pretraining_text(rng: random.Random, num_documents: int) -> list[str]:
    """Generic documents over the task vocabulary: copying, counting, alphabetical runs.

    Args:
        rng: The seeded random source.
        num_documents: How many documents to make.

    Returns:
        Plain-text documents (no special tokens).
    """
    documents = []
    for index in range(num_documents):
        kind = index % 5
        if kind == 0:  # a phrase and its copy: teaches the model to attend back and copy
            phrase = " ".join(rng.sample(WORDS, rng.randint(3, 6)))
            documents.append(f"{phrase}. {phrase}.")
        elif kind == 1:  # counting up
            start = rng.randint(0, MAX_NUMBER - 8)
            documents.append(" ".join(str(n) for n in range(start, start + rng.randint(4, 8))))
        elif kind == 2:  # letters in alphabetical order
            documents.append(" ".join(sorted(rng.sample(LETTERS, rng.randint(3, 8)))))
        elif kind == 3:  # the instructions' words, without their answers
            example = rng.choice(TASKS)(rng)
            documents.append(f"{example.prompt}. {example.instruction} {SYSTEM_PROMPT}")
        else:  # a sentence of random words
            documents.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) + ".")
    return documents
