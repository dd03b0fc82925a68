"""Running lm-eval tasks on a model: which tasks, the run, the results table.

A task is named as lm-eval's registry names it (``hellaswag``, ``mmlu``, ``arc_easy``) or
given as a task YAML file, or a folder of them (every task the folder defines). Indexing
lm-eval's registry of over ten thousand task files takes half a minute, so it is read only
when a registry name is asked for.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tunelab._hub import offline_unless_hub_answers, unreachable_reason
from tunelab.config._tasks import task_path_problem
from tunelab.errors import ConfigError, first_line
from tunelab.eval import _lm_eval  # the install hint when lm-eval is missing

__all__ = ["evaluate", "resolve_tasks", "results_table"]


def resolve_tasks(tasks: Sequence[str]) -> tuple[list[str | dict[str, Any]], Any]:
    """The task names and YAML paths to run, and the ``TaskManager`` that finds them.

    Args:
        tasks: Registry names, task YAML files, or folders of task YAML files.

    Returns:
        ``(specs, task_manager)``: ``specs`` as ``lm_eval.simple_evaluate`` takes them (a
        folder becomes the names of the tasks it defines; a task file whose ``data_files``
        are relative becomes its config, those paths taken from the file's folder).

    Raises:
        ConfigError: A path that does not exist, a folder without tasks, or a name neither
            the registry nor the given folders know (with the closest names).
    """
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError("no tasks to evaluate: give tasks, e.g. tasks=[arc_easy]")
    folders: list[Path] = []
    for task in tasks:
        problem = task_path_problem(task)
        if problem is not None:
            raise ConfigError(problem)
        path = Path(task).expanduser()
        if path.is_dir():
            folders.append(path.resolve())
    registry_names = [t for t in tasks if not Path(t).expanduser().exists()]
    manager = TaskManager(include_path=folders or None, include_defaults=bool(registry_names))
    specs: list[str | dict[str, Any]] = []
    for task in tasks:
        path = Path(task).expanduser()
        if path.is_dir():
            folder = path.resolve()
            defined = sorted(
                (name, entry)
                for name, entry in manager.task_index.items()
                if entry.yaml_path is not None
                and Path(entry.yaml_path).resolve().parent == folder
                and entry.kind.name in ("TASK", "PY_TASK", "GROUP")
            )
            if not defined:
                raise ConfigError(
                    f"task folder {task}: defines no task (no YAML with a 'task' key)"
                )
            # A task's file, so that its relative data_files are read from the folder (by name,
            # lm-eval would read them from the working directory); groups and Python tasks
            # by name.
            specs += [
                _task_file_spec(Path(entry.yaml_path).resolve())
                if entry.kind.name == "TASK"
                else name
                for name, entry in defined
            ]
        elif path.is_file():
            specs.append(_task_file_spec(path.resolve()))
        elif task not in manager.all_tasks:
            close = difflib.get_close_matches(task, manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"task {task!r} is not in lm-eval's registry{hint}")
        else:
            specs.append(task)
    unique: dict[str, str | dict[str, Any]] = {}
    for spec in specs:  # a task named twice runs once
        unique.setdefault(spec if isinstance(spec, str) else spec["task"], spec)
    return list(unique.values()), manager


def _task_file_spec(path: Path) -> str | dict[str, Any]:
    """A task YAML file as lm-eval takes it, its relative ``data_files`` made relative to it.

    lm-eval hands ``dataset_kwargs.data_files`` to ``datasets``, which reads relative paths
    from the working directory; a task shipped with its data next to it should work from
    anywhere, so such paths are resolved against the YAML's folder (the task then goes to
    lm-eval as its config dict).
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(path)
    data_files = (config.get("dataset_kwargs") or {}).get("data_files")
    if data_files is None or not isinstance(config.get("task"), str):
        return str(path)

    def anchored(value: Any) -> Any:
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            return str(path.parent / value)
        if isinstance(value, list):
            return [anchored(item) for item in value]
        if isinstance(value, dict):
            return {key: anchored(item) for key, item in value.items()}
        return value

    config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": anchored(data_files)}
    return config


def evaluate(
    lm: Any,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: int | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    seed: int = 0,
) -> dict[str, Any] | None:
    """Evaluate ``lm`` on lm-eval tasks (every rank calls it; rank 0 gets the results).

    Args:
        lm: An lm-eval ``LM``, e.g. :class:`~tunelab.eval.TunelabLM`.
        tasks: Registry names, task YAML files or folders.
        num_fewshot: Examples in each prompt (None: each task's own setting).
        limit: Documents per task at most (None: all).
        apply_chat_template: Render prompts with the tokenizer's chat template.
        log_samples: Keep every document's requests and responses under ``samples``.
        seed: Seed of lm-eval's few-shot sampling and shuffles.

    Returns:
        lm-eval's results dict on rank 0 (``results``, ``configs``, ``versions``,
        ``n-shot``, ... and ``samples`` with ``log_samples``); None on the other ranks.

    Raises:
        ConfigError: An unknown task, or a task whose dataset must come from the Hugging Face
            Hub while the hub cannot be reached (offline): the message names the task.
    """
    specs, manager = resolve_tasks(tasks)
    return run_resolved(
        lm,
        specs,
        manager,
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
        seed=seed,
    )


def run_resolved(
    lm: Any,
    specs: list[str | dict[str, Any]],
    manager: Any,
    *,
    num_fewshot: int | None,
    limit: int | None,
    apply_chat_template: bool,
    log_samples: bool,
    seed: int,
    bootstrap_iters: int = 100000,
    quiet: bool = False,
) -> dict[str, Any] | None:
    """:func:`evaluate` on tasks :func:`resolve_tasks` already found (no second registry scan).

    Args:
        lm: An lm-eval ``LM``.
        specs: The task specs from :func:`resolve_tasks`.
        manager: Its ``TaskManager``.
        num_fewshot: See :func:`evaluate`.
        limit: See :func:`evaluate`.
        apply_chat_template: See :func:`evaluate`.
        log_samples: See :func:`evaluate`.
        seed: See :func:`evaluate`.
        bootstrap_iters: Resamples for the standard errors of metrics that lm-eval bootstraps
            (perplexity, ...) in a pool of forked processes; 0: no standard errors and no
            fork (a fork of a training process, with its checkpoint and collective threads,
            can deadlock).
        quiet: Without lm-eval's progress bars too (between training steps); git's complaint
            outside a repository and ``datasets``' bars are off either way.

    Returns:
        lm-eval's results dict on rank 0; None on the other ranks.

    Raises:
        ConfigError: A task's dataset must come from the Hugging Face Hub while it cannot be
            reached.
    """
    import lm_eval

    # lm-eval logs a warning per metric of a local task without aggregation settings.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    _check_hub(specs)
    try:
        with _lm_eval.quiet() if quiet else _lm_eval.no_stray_output():
            return lm_eval.simple_evaluate(
                model=lm,
                tasks=specs,
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                apply_chat_template=apply_chat_template,
                log_samples=log_samples,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                bootstrap_iters=bootstrap_iters,
            )
    except (ConnectionError, OSError) as error:
        raise _unreachable_dataset(specs, manager, error) from None


def check_datasets(specs: list[str | dict[str, Any]], manager: Any) -> None:
    """Load every task once, so a dataset that cannot be had fails now, naming its task.

    Args:
        specs: The task specs from :func:`resolve_tasks`.
        manager: Its ``TaskManager``.

    Raises:
        ConfigError: A task's dataset must come from the Hugging Face Hub while it cannot be
            reached (offline), or cannot be read.
    """
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    _check_hub(specs)
    try:
        with _lm_eval.no_stray_output():
            manager.load(specs)
    except (ConnectionError, OSError) as error:
        raise _unreachable_dataset(specs, manager, error) from None


# `datasets` builders that read local files: a task over one of them needs no hub.
_LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})


def _check_hub(specs: list[str | dict[str, Any]]) -> None:
    """Before a task that may need the hub loads: offline mode at once if it cannot be reached.

    Without this an unreachable hub costs about 25 s of retries per dataset load, with a line
    each (``tunelab._hub``). Tasks over local files (a task file whose ``dataset_path`` is
    a local builder such as ``json``, or a folder) never ask.
    """
    if any(not _reads_local_files(spec) for spec in specs):
        offline_unless_hub_answers()


def _reads_local_files(spec: str | dict[str, Any]) -> bool:
    """Whether a task spec surely loads its data from local files (else: it may need the hub)."""
    config: Any = spec
    if isinstance(spec, str):
        if not Path(spec).is_file():
            return False  # a registry name
        from lm_eval.tasks._yaml_loader import load_yaml

        try:
            config = load_yaml(spec, resolve_func=False)
        except Exception:  # noqa: BLE001 - lm-eval says what is wrong with the file itself
            return False
    path = config.get("dataset_path") if isinstance(config, dict) else None
    if not isinstance(path, str) or "include" in config:
        return False  # inherited settings: not known here
    return path in _LOCAL_BUILDERS or Path(path).expanduser().is_dir()


def _unreachable_dataset(specs: list[Any], manager: Any, error: Exception) -> Exception:
    """Name the task whose dataset could not be fetched (each task loaded alone to find it)."""
    if not isinstance(error, ConnectionError) and "hub" not in str(error).lower():
        return error
    # Why the hub could not be had: the check's answer says more than the library's error.
    why = unreachable_reason()
    for spec in specs:
        try:
            with _lm_eval.no_stray_output():
                manager.load([spec])
        except (ConnectionError, OSError) as task_error:
            name = spec.get("task") if isinstance(spec, dict) else _task_name(spec)
            return ConfigError(
                f"task {name!r}: its dataset could "
                f"not be loaded without the Hugging Face Hub ({why or first_line(task_error)}); "
                "run once with network access to cache it, or give a task over local files"
            )
    return ConfigError(f"a task's dataset could not be loaded: {first_line(error)}")


def _task_name(spec: str) -> str:
    # A task file is named by its `task:` key (the path when it has none).
    from lm_eval.tasks._yaml_loader import load_yaml

    if not Path(spec).is_file():
        return spec
    name = load_yaml(spec, resolve_func=False).get("task")
    return name if isinstance(name, str) else spec


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's results as one table: task, filter, shots, metric, value and stderr.

    Args:
        results: What :func:`evaluate` returns on rank 0.

    Returns:
        The table (Markdown, as ``lm_eval`` prints it).
    """
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table
