"""Driving a trainer one step at a time, for tests that look between steps: what the run loop does
per step (the fault hooks, the batch read in the ``data`` phase, the judged step, the step
advanced), without its saves, evaluation, metrics or stop signals."""


def train_step(trainer):
    """Global step ``trainer.step``, run and advanced; its :class:`~hpctrain.training.step.StepResult`
    (the loss and counts summed over the world's whole batch)."""
    step = trainer.step
    trainer.faults.pace()
    with trainer.timers("data"):
        x, y = trainer.data.reader.batch(step)
        x = trainer.faults.before_step(step, x)
    result = trainer.stepper.run(step, x, y)
    trainer.step += 1
    return result


def train_losses(trainer, steps: int) -> list:
    """(loss_sum, correct) of each of the next ``steps`` steps (:func:`train_step`)."""
    return [(r.loss_sum, r.correct) for r in (train_step(trainer) for _ in range(steps))]
