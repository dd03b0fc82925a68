import json
import math

import pytest
import torch

from tunelab.training import (
    JsonlLogger,
    StdoutLogger,
    constant_schedule_with_warmup,
    cosine_schedule_with_warmup,
)


def _lrs(make, steps, **kwargs):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = make(optimizer, steps, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_cosine_schedule_warms_up_linearly_then_follows_the_half_cosine():
    lrs = _lrs(cosine_schedule_with_warmup, 6, num_warmup_steps=2)
    # warmup: 0/2, 1/2 of the peak; then 0.5 * (1 + cos(pi * k / 4)) for k = 0..3
    expected = [0.0, 1.0] + [2.0 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx(expected)


def test_cosine_schedule_floor_and_constant_schedule():
    lrs = _lrs(cosine_schedule_with_warmup, 3, min_lr_ratio=0.5)
    assert lrs == pytest.approx(
        [
            2.0,
            2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 3))),
            2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(2 * math.pi / 3))),
        ]
    )
    assert _lrs(constant_schedule_with_warmup, 4, num_warmup_steps=2) == pytest.approx(
        [0.0, 1.0, 2.0, 2.0]
    )


def test_jsonl_logger_appends_one_object_per_step(tmp_path):
    logger = JsonlLogger(str(tmp_path / "logs"))
    logger.log({"loss": 1.5, "lr": 0.1}, 1)
    logger.log({"val_loss": 2.0}, 1)
    logger.close()
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 1.5, "lr": 0.1},
        {"step": 1, "val_loss": 2.0},
    ]


def test_stdout_logger_prints_one_line(capsys):
    StdoutLogger().log({"loss": 1.23456789, "tokens": 7}, 3)
    assert capsys.readouterr().out == "step 3 | loss 1.23457 | tokens 7\n"
