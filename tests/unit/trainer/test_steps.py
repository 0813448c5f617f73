"""The step-strategy seam (ddptrain.trainer.steps): a strategy's own state travels in checkpoints,
and a checkpoint holding state the resuming strategy does not keep is refused with the reason."""

import pytest
import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer
from ddptrain.trainer.checkpoint import load_checkpoint
from ddptrain.trainer.steps import DataParallelSteps


def _config(out, **trainer):
    return Config.from_dict(
        {
            "model": {"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 3},
            "data": {"global_batch_size": 10, "eval_batch_size": 7},
            "trainer": {
                "epochs": 1,
                "progress": False,
                "loggers": {"tensorboard": False},
                "output_dir": str(out),
                **trainer,
            },
        }
    )


class CountingSteps(DataParallelSteps):
    """Plain DDP that keeps one number across steps: the optimizer steps it ran (ever, resumes included)."""

    def __init__(self, trainer, votes):
        super().__init__(trainer, votes)
        self.count = 0
        self.loaded = None

    def optimizer_step(self):
        super().optimizer_step()
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.count = state["count"]


class Task(Trainer):
    def train_dataloader(self):
        x = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataloader(self):
        return None


class CountingTask(Task):
    def configure_step_strategy(self, votes):
        return CountingSteps(self, votes)


def test_a_strategys_state_is_saved_and_restored(tmp_path):
    first = CountingTask(_config(tmp_path / "a", max_steps=3))
    first.fit()
    saved = load_checkpoint(tmp_path / "a" / "checkpoints" / "step_000000003.pt")
    assert saved["strategy"] == {"count": 3}
    resumed = CountingTask(_config(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoints" / "step_000000003.pt")))
    resumed.fit()
    assert resumed.strategy.loaded == {"count": 3}
    assert resumed.strategy.count == 4  # 40 samples / 10 per step: one epoch is 4 steps, 3 were done


def test_a_plain_run_refuses_a_checkpoint_with_strategy_state(tmp_path):
    CountingTask(_config(tmp_path / "a", max_steps=2)).fit()
    plain = Task(_config(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoints" / "step_000000002.pt")))
    with pytest.raises(ValueError, match=r"step-strategy state \(count\) that DataParallelSteps does not keep"):
        plain.fit()
