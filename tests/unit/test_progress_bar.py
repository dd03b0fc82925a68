"""The progress bar shows the step's figures, and RL's mean reward when there is one."""

from tunelab.training import ProgressBar


def test_the_bar_shows_the_reward_of_rl_steps(capsys):
    bar = ProgressBar(2)
    bar.update(loss=0.5, lr=1e-3, tokens_per_second=100.0)
    bar.update(loss=0.25, lr=1e-3, tokens_per_second=100.0, reward=0.625)
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.5000, lr=1.00e-03, tok_s=100]" in err  # no reward: none shown
    assert "loss=0.2500, lr=1.00e-03, tok_s=100, reward=0.625]" in err
