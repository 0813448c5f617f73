"""An MNIST trainer whose first membership change holds for a while before the state is handed
over, so a test can lose another member in the middle of a change.

``recipe.trainer_class=tests.elastic.slow_hand_over.SlowHandOverTrainer``: when a survivor rebinds to
generation 1 (after the new group is formed, before the state is agreed), it prints
``hand-over held`` and sleeps ``HOLD_S``. The numbers are those of ``recipe=mnist``.
"""

import time

from ddptrain.recipes.mnist import MnistTrainer

HOLD_S = 3.0


class SlowHandOverTrainer(MnistTrainer):
    def configure_step_strategy(self, votes):
        if self.elastic is not None and self.elastic.generation.number == 1 and not self.elastic.joined_late:
            print(f"hand-over held: generation 1, rank {self.rank}", flush=True)
            time.sleep(HOLD_S)
        return super().configure_step_strategy(votes)
