"""A user's trainer that decides in ``training_step`` to stop: rank 1 only, in the 8th optimizer step.

``recipe.trainer_class=tests.e2e.stop_at_step.StopAtStep8``. Every rank writes the step it ended
at to ``<run dir>/ended_rank<r>.txt``, so a test sees each rank's end, not only rank 0's metrics.
"""

import ddptrain

STOP_IN_STEP = 8


class StopAtStep8(ddptrain.Trainer):
    def training_step(self, model, batch):
        if self.rank == 1 and self.state.step + 1 == STOP_IN_STEP:  # state.step: steps done before this one
            self.should_stop = True
        return super().training_step(model, batch)

    def fit(self):
        final = super().fit()
        (self.output_dir / f"ended_rank{self.rank}.txt").write_text(str(self.state.step))
        return final
