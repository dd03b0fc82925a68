"""`tunelab validate` refuses agentic episodes that cannot fit the model's context, in one line.

An episode's KV cache holds its prompt and ``agentic.max_episode_tokens`` (replies, template
and tool tokens), so validate checks that length, not ``rollout.max_new_tokens`` (one reply),
against ``max_position_embeddings``; the run itself still refuses a longer rendered prompt.
"""

import pytest

from tunelab import _paths
from tunelab.cli.main import main

TINY = _paths.assets_dir() / "tiny"  # max_position_embeddings 512


def validate(capsys, *overrides: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(["validate", "tiny/agentic_grpo", f"model.path={TINY}", *overrides])
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        (
            ["agentic.max_episode_tokens=512"],
            "key 'agentic.max_episode_tokens': 512 tokens leave no room for a prompt in the "
            "model's context (max_position_embeddings 512 of",
        ),
        (
            ["dataset.max_prompt_tokens=401"],
            "key 'dataset.max_prompt_tokens': 401 prompt tokens + agentic.max_episode_tokens 112 "
            "= 513 exceed the model's context",
        ),
    ],
)
def test_validate_refuses_an_episode_past_the_context(tmp_path, capsys, overrides, expect):
    code, err = validate(capsys, f"output_dir={tmp_path}/out", *overrides)
    assert code == 1 and expect in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_validate_takes_an_episode_that_fits(tmp_path, capsys):
    code, err = validate(capsys, f"output_dir={tmp_path}/out", "dataset.max_prompt_tokens=400")
    assert code == 0, err
