"""``python -m ddptrain.doctor <the run's overrides>``: measure a short window and diagnose it.

The same command line as ``python -m ddptrain`` (recipe, groups, keys), run with
``trainer.doctor=true`` for ``doctor.warmup_steps + doctor.steps`` steps, without checkpoints,
periodic evaluation or the smoke check (each unless given on the command line). The report is
printed by rank 0 and written to ``<run dir>/doctor.json`` and ``<run dir>/doctor_trace.json``.
"""

from __future__ import annotations

import sys

from ..cli import main as cli_main
from ..config import DoctorConfig


def doctor_argv(argv: list[str]) -> list[str]:
    """``argv`` plus the overrides of a doctor-only run (those the user did not set)."""
    given = {a.split("=", 1)[0].lstrip("+~"): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    warmup = int(given.get("doctor.warmup_steps", DoctorConfig.warmup_steps))
    steps = int(given.get("doctor.steps", DoctorConfig.steps))
    extra = {
        "trainer.doctor": "true",
        "trainer.max_steps": str(warmup + steps),
        "trainer.checkpoint.every_epochs": "0",
        "trainer.checkpoint.at_end": "false",
        "trainer.eval_every_epochs": "0",
        "trainer.smoke_check": "false",
    }
    return [*argv, *(f"{k}={v}" for k, v in extra.items() if k not in given)]


def main(argv: list[str] | None = None) -> None:
    cli_main(doctor_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
