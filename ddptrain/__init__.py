"""ddptrain: distributed data-parallel training with its own DDP, process groups and trainer."""
__version__ = "0.1.0"
