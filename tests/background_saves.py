"""A test callback for checkpoints written in the background (``trainer.checkpoint.async_save``)."""

import torch

from ddptrain.trainer.callbacks import Callback

__all__ = ["ScribbleWhileWriting"]


class ScribbleWhileWriting(Callback):
    """Right after each save of an even step, change every parameter until the save is written,
    then put them back: a checkpoint must hold its step's state, whatever the live tensors hold
    while it is being written in the background."""

    def on_train_batch_end(self, trainer, loss):
        if trainer.state.step % 2:
            return
        params = list(trainer.model.module.parameters())
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(1.0)
            trainer.checkpointer.finish()  # the background write, done while the parameters were off
            for p, value in zip(params, kept):
                p.copy_(value)
