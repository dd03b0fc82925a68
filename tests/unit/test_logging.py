"""Library logging: one handler on the ``tunelab`` logger, its level from TUNELAB_LOG_LEVEL."""

import ast
import logging
from pathlib import Path

import pytest

from tunelab.lifecycle.entry import _ProgressSafeHandler, configure_logging

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "framework" / "tunelab"


@pytest.fixture
def tunelab_logger():
    logger = logging.getLogger("tunelab")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    logger.handlers.clear()
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.mark.parametrize(
    "setting, rank, level",
    [
        (None, "0", logging.INFO),
        (None, "1", logging.WARNING),
        ("debug", "0", logging.DEBUG),
        ("DEBUG", "1", logging.WARNING),  # other ranks never log below WARNING
        ("error", "0", logging.ERROR),
        ("error", "1", logging.ERROR),
    ],
)
def test_log_level_by_rank_and_setting(tunelab_logger, monkeypatch, setting, rank, level):
    monkeypatch.setenv("RANK", rank)
    if setting is None:
        monkeypatch.delenv("TUNELAB_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TUNELAB_LOG_LEVEL", setting)
    configure_logging()
    configure_logging()  # idempotent: still one handler
    assert tunelab_logger.level == level
    ours = [h for h in tunelab_logger.handlers if isinstance(h, _ProgressSafeHandler)]
    assert len(ours) == 1 and not tunelab_logger.propagate


def test_debug_lines_are_written_and_say_their_level(tunelab_logger, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TUNELAB_LOG_LEVEL", "DEBUG")
    configure_logging()
    logging.getLogger("tunelab.training.loop").debug("detail %d", 7)
    logging.getLogger("tunelab.checkpoint.client").info("committed")
    assert capsys.readouterr().err.splitlines() == [
        "tunelab: debug: detail 7",
        "tunelab: committed",
    ]


def test_an_unknown_level_warns_and_keeps_info(tunelab_logger, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TUNELAB_LOG_LEVEL", "verbose")
    configure_logging()
    assert tunelab_logger.level == logging.INFO
    assert capsys.readouterr().err == (
        "tunelab: warning: TUNELAB_LOG_LEVEL=verbose is not a log level "
        "(DEBUG, INFO, WARNING, ERROR, CRITICAL): using INFO\n"
    )


def test_library_modules_log_under_their_own_name():
    # A module logger named otherwise may escape the ``tunelab`` handler and its level.
    offenders = []
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "logging.getLogger"
                and [ast.unparse(arg) for arg in node.value.args] != ["__name__"]
            ):
                offenders.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
    assert not offenders
