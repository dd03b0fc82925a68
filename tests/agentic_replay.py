"""A policy stand-in for agentic episode tests: it replays a reference conversation's replies.

Each turn it replies with the reference ids from where the episode stands through the next
stop token, so every token that is not a reply (prompt, template, tool results) comes from
the code under test. It has the ``CachedTurnSampler`` interface and records what it was fed.
"""

import contextlib
from types import SimpleNamespace

from tunelab.rl import SamplingSettings


class ReplayPolicy:
    """Replays ``references[row]`` for each row of a batch of episodes."""

    def __init__(self, references, stop_ids):
        self.references = references if isinstance(references[0], list) else [references]
        self.stop_ids = set(stop_ids)
        self.settings = SamplingSettings(max_new_tokens=400, stop_ids=frozenset(stop_ids))
        # A model with no parameters: its forwards are local (no turn is agreed over ranks).
        self.model = SimpleNamespace(args=SimpleNamespace(max_seq_len=8192), parameters=list)
        self.prefill_tokens = self.generated_tokens = 0
        self.entropy_sum = 0.0  # a replay samples nothing
        self.turns = 0  # calls of turn (one per turn of the batch)
        rows = len(self.references)
        self.fed = [[] for _ in range(rows)]
        self.replies = [[] for _ in range(rows)]
        self.sequences = [[] for _ in range(rows)]

    def session(self, rows, capacity):
        return contextlib.nullcontext(self)

    def turn(self, new_tokens, generators, max_new_tokens):
        self.turns += 1
        replies = []
        for row, tokens in enumerate(new_tokens):
            if tokens is None:
                replies.append([])
                continue
            reference, sequence = self.references[row], self.sequences[row]
            self.fed[row].append(list(tokens))
            sequence += tokens
            end = len(sequence)
            while reference[end] not in self.stop_ids:
                end += 1
            reply = reference[len(sequence) : end + 1]
            sequence += reply
            self.replies[row].append(reply)
            replies.append(reply)
        return replies
