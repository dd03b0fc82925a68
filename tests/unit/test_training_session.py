from tunelab.config.recipe_args import CheckpointArgs
from tunelab.config.sections import ScheduleArgs
from tunelab.training.session import Schedule


def _args(**checkpoint):
    return Schedule(
        ScheduleArgs(epochs=3, log_every_n_steps=2, run_val_every_n_steps=5),
        CheckpointArgs(**checkpoint),
    )


def test_schedule_saves_every_n_steps_and_at_epoch_ends():
    schedule = _args(save_every_n_steps=4)
    assert [step for step in range(1, 13) if schedule.save(step, epoch_done=False)] == [4, 8, 12]
    assert schedule.save(7, epoch_done=True)
    assert not (_args()).save(4, epoch_done=False)  # None: only at epoch ends


def test_schedule_exports_every_n_epochs_and_always_the_last():
    schedule = _args(export_every_n_epochs=2)
    assert [e for e in range(3) if schedule.export(e, epoch_done=True)] == [1, 2]
    assert not schedule.export(1, epoch_done=False)
    assert schedule.is_last(2, epoch_done=True) and not schedule.is_last(2, epoch_done=False)


def test_schedule_validates_and_logs_on_their_intervals():
    schedule = _args()
    assert [s for s in range(1, 11) if schedule.validate(s, epoch_done=False)] == [5, 10]
    assert schedule.validate(3, epoch_done=True)
    assert [s for s in range(1, 6) if schedule.log(s)] == [2, 4]
