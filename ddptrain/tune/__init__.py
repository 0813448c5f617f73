"""Finding settings by trying them: ``python -m ddptrain.tune lr|batch_size`` (see ``__main__``).

:mod:`.lr_find` is the learning-rate range test (a callback the runner adds for
``trainer.lr_find``); :mod:`.batch_size` the largest batch that fits.
"""
