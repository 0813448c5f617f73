"""``recipe.trainer_class=tests.e2e.broken_validation.BrokenValidation``: the plain Trainer whose
``validation_step`` raises, for the tests of the checks that must catch it early."""

import ddptrain


class BrokenValidation(ddptrain.Trainer):
    def validation_step(self, model, batch):
        raise RuntimeError("validation_step is broken on purpose")
