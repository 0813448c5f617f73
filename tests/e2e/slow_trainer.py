"""A Trainer whose steps take a little while, so a test can signal a run in its middle.

``recipe.trainer_class=tests.e2e.slow_trainer.SlowTrainer``: the plain Trainer with a 40 ms pause
in every training step (the numbers are those of the plain Trainer).
"""

import time

import ddptrain


class SlowTrainer(ddptrain.Trainer):
    def training_step(self, model, batch):
        time.sleep(0.04)
        return super().training_step(model, batch)
