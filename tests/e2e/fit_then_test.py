"""A user's script under torchrun: fit, then test and predict (each joins the job's group again).

Writes one JSON file per rank into the directory ``sys.argv[2]``: the test metrics and a digest of
the predictions. Files, not stdout: two ranks printing to one pipe can interleave their lines.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ddptrain import Config, Trainer


class Task(Trainer):
    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x[:, :3].argmax(1))

    def val_dataloader(self):
        x = torch.randn(29, 8, generator=torch.Generator().manual_seed(1))
        return TensorDataset(x, x[:, :3].argmax(1))


if __name__ == "__main__":
    config = Config.from_dict(
        {
            "model": {"_target_": "torch.nn.Linear", "in_features": 8, "out_features": 3},
            "data": {"global_batch_size": 16, "eval_batch_size": 4},
            "trainer": {"epochs": 1, "progress": "false", "loggers": {"tensorboard": False}, "output_dir": sys.argv[1]},
        }
    )
    trainer = Task(config)
    trainer.fit()
    first = trainer.test()
    predictions = trainer.predict(trainer.val_dataloader())
    again = trainer.test()
    digest = hashlib.sha256(predictions.numpy().tobytes()).hexdigest()
    result = {"rank": trainer.rank, "test": first, "again": again, "rows": len(predictions), "digest": digest}
    Path(sys.argv[2], f"rank{trainer.rank}.json").write_text(json.dumps(result))
