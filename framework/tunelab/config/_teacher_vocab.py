"""A distillation teacher's vocabulary against the student's: equal, mapped, or refused.

Distillation compares the two models' distributions token by token, so the teacher's logit of
each student token must be found. Teacher and student of one tokenizer family share the
ordinary vocabulary (the tokenizer model's tokens and merges) but may differ in their special
(added) tokens: another id, or a token only one of them has. Those are matched by content:

- every ordinary token must have the same id in both (else refused: another tokenizer);
- each special token of the student takes the teacher's token with the same content (else
  refused: the teacher cannot score it);
- the teacher's special tokens that the student lacks are left out (the teacher's
  distribution is renormalised over the student's tokens);
- student embedding rows past its tokenizer (padding rows, no content) take the teacher's
  smallest logit of that position (a finite, negligible probability; never -inf, which would
  make a reverse KL infinite).

This module reads JSON only and must not import torch (``tunelab validate`` uses it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VocabularyMap", "map_vocabularies"]


@dataclass(frozen=True)
class VocabularyMap:
    """How the teacher's logits become the student's vocabulary order.

    Attributes:
        teacher_ids: For each student id, the teacher's id; ``teacher_size`` (one past the
            teacher's last row) for a student padding row (the teacher's smallest logit).
            None when the vocabularies are the same (nothing to map).
        mapped: ``(content, student id, teacher id)`` of the special tokens whose ids differ.
        left_out: Contents of the teacher's special tokens the student does not have.
    """

    teacher_ids: list[int] | None
    mapped: list[tuple[str, int, int]]
    left_out: list[str]

    def describe(self) -> str:
        """One line saying what was mapped and what was left out."""
        parts = []
        if self.mapped:
            pairs = ", ".join(f"{c} {t}->{s}" for c, s, t in self.mapped)
            parts.append(f"special tokens mapped by content (teacher id->student id): {pairs}")
        if self.left_out:
            parts.append(f"teacher-only special tokens left out: {', '.join(self.left_out)}")
        return "; ".join(parts) or (
            "only rows without a token differ (student padding rows take the teacher's smallest "
            "logit, teacher rows past the student's vocabulary are left out)"
        )


def _read_tokenizer(folder: Path) -> tuple[dict, dict[str, int], dict[str, int]] | None:
    # (model section without its vocabulary, ordinary vocabulary, special tokens by content)
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    added = {
        token["content"]: int(token["id"])
        for token in data.get("added_tokens") or []
        if isinstance(token, dict) and "content" in token and "id" in token
    }
    model = dict(data.get("model") or {})
    vocab = model.pop("vocab", {}) or {}
    ordinary = {token: int(index) for token, index in vocab.items() if token not in added}
    return model, ordinary, added


def map_vocabularies(
    student_dir: str | Path, teacher_dir: str | Path, student_size: int, teacher_size: int
) -> VocabularyMap:
    """Match the teacher's vocabulary to the student's (see the module docstring).

    Args:
        student_dir: Folder of the student's ``tokenizer.json``.
        teacher_dir: Folder of the teacher's ``tokenizer.json``.
        student_size: The student's embedding rows (``vocab_size``).
        teacher_size: The teacher's.

    Returns:
        The map (``teacher_ids`` None when nothing differs).

    Raises:
        ValueError: One phrase saying what differs beyond special tokens (or that a folder has
            no ``tokenizer.json`` while the sizes differ).
    """
    student = _read_tokenizer(Path(student_dir).expanduser())
    teacher = _read_tokenizer(Path(teacher_dir).expanduser())
    if student is None or teacher is None:
        if student_size != teacher_size:
            raise ValueError(
                f"the teacher's vocabulary ({teacher_size} tokens) differs from the student's "
                f"({student_size}), and without both tokenizer.json files it cannot be mapped"
            )
        return VocabularyMap(None, [], [])
    student_model, student_ordinary, student_added = student
    teacher_model, teacher_ordinary, teacher_added = teacher
    if student_model != teacher_model or student_ordinary != teacher_ordinary:
        differing = sorted(
            token
            for token in student_ordinary.keys() | teacher_ordinary.keys()
            if student_ordinary.get(token) != teacher_ordinary.get(token)
        )
        what = f"tokens such as {differing[:3]}" if differing else "their merges or model"
        raise ValueError(
            f"the teacher's tokenizer differs from the student's beyond special tokens ({what}); "
            "distillation needs one tokenizer family"
        )
    teacher_by_content = {**teacher_ordinary, **teacher_added}
    missing = sorted(set(student_added) - set(teacher_by_content))
    if missing:
        raise ValueError(
            f"the student's special tokens {missing} are not in the teacher's tokenizer: the "
            "teacher cannot score them"
        )
    by_student_id = {index: content for content, index in student_added.items()}
    ordinary_ids = set(student_ordinary.values())
    teacher_ids, mapped = [], []
    for student_id in range(student_size):
        if student_id in by_student_id:
            content = by_student_id[student_id]
            teacher_id = teacher_by_content[content]
            if teacher_id != student_id:
                mapped.append((content, student_id, teacher_id))
        elif student_id in ordinary_ids and student_id < teacher_size:
            teacher_id = student_id
        else:
            teacher_id = teacher_size  # a padding row
        if teacher_id >= teacher_size and student_id in by_student_id:
            raise ValueError(
                f"the teacher's tokenizer gives {by_student_id[student_id]!r} id {teacher_id}, "
                f"past its {teacher_size} embedding rows"
            )
        teacher_ids.append(teacher_id)
    left_out = sorted(set(teacher_added) - set(student_added))
    identical = student_size == teacher_size and teacher_ids == list(range(student_size))
    if identical or (not mapped and not left_out and student_size == teacher_size):
        return VocabularyMap(None, [], [])
    return VocabularyMap(teacher_ids, mapped, left_out)
