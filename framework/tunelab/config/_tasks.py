"""Telling an lm-eval task given as a file or folder from a registry name, without lm-eval.

``tunelab validate`` checks the task paths a config names (no lm-eval import, no torch); the
evaluation itself (``tunelab.eval``) reads the same rule.
"""

from pathlib import Path

YAML_SUFFIXES = (".yaml", ".yml")


def looks_like_task_path(task: str) -> bool:
    """Whether ``task`` is meant as a path (a separator, a YAML suffix, a leading dot)."""
    return "/" in task or task.endswith(YAML_SUFFIXES) or task.startswith(".")


def task_path_problem(task: str) -> str | None:
    """What is wrong with a task given as a path, or None (a registry name, or a usable path).

    Args:
        task: A registry name, a task YAML file or a folder of them.

    Returns:
        One message naming the task, or None.
    """
    path = Path(task).expanduser()
    if path.is_dir():
        return None
    if path.is_file():
        return (
            None
            if task.endswith(YAML_SUFFIXES)
            else f"task {task!r}: a task file is a .yaml or .yml file"
        )
    if looks_like_task_path(task):
        return f"task {task!r}: no such task file or folder"
    return None
