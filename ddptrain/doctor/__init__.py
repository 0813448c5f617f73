"""``ddptrain doctor``: why a distributed run is slow, how it scales, what to change.

``trainer.doctor=true`` measures a window of steps inside a run; ``python -m ddptrain.doctor
<overrides>`` runs only that window. Either writes ``<run dir>/doctor.json`` (see
:mod:`.report` for its shape), ``<run dir>/doctor_trace.json`` (:mod:`.timeline`) and prints a
short report. Parts: :mod:`.measure` (per-step phase timings), :mod:`.link` (all-reduce sweep,
alpha-beta fit), :mod:`.diagnose` (the causes), :mod:`.predict` (overlap and scaling model),
:mod:`.session` (the callback that ties them together).
"""

from __future__ import annotations

from .diagnose import JobFacts, diagnose, summarize
from .link import LinkModel, sweep
from .predict import StepModel, exposed_comm_s
from .session import DoctorCallback, doctor_callbacks

__all__ = [
    "DoctorCallback",
    "doctor_callbacks",
    "JobFacts",
    "LinkModel",
    "StepModel",
    "diagnose",
    "exposed_comm_s",
    "summarize",
    "sweep",
]
