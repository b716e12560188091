"""Driving a trainer one step at a time, as its run loop does, for tests that look between steps."""


def train_step(trainer):
    """Global step ``trainer.step``: its batch read through the fault hooks, the judged step
    (:meth:`hpctrain.training.step.Step.run`), the step advanced; (loss_sum, correct) summed over
    the world's whole batch."""
    step = trainer.step
    x, y = trainer.data.reader.batch(step)
    result = trainer.stepper.run(step, trainer.faults.before_step(step, x), y)
    trainer.step += 1
    return result.loss_sum, result.correct
