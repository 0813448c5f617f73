"""Training modes and features: which step strategy trains a config, and what each refuses.

The mechanics are in :mod:`.registry`; ddptrain's own modes and features, each with its rules, in
:mod:`.builtin` (registered on import). Add a mode with one strategy class and one
``register(Mode(...))``: no edit to the Trainer or to anyone else's rules (docs/architecture.md:
Adding a mode). Torch-free.
"""

from . import builtin as _builtin  # noqa: F401  (registers ddptrain's own modes and features)
from .registry import (
    Feature,
    Mode,
    Refusal,
    check_config,
    features,
    mode_of,
    refuse,
    register,
    registered,
    shares_unevenly,
)

__all__ = [
    "Feature",
    "Mode",
    "Refusal",
    "check_config",
    "features",
    "mode_of",
    "refuse",
    "register",
    "registered",
    "shares_unevenly",
]
