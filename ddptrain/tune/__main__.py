"""``python -m ddptrain.tune lr|batch_size <the run's overrides> [--apply]``: find a setting by trying it.

* ``lr``: the learning-rate range test (:mod:`.lr_find`) on every rank, with the command line of
  ``python -m ddptrain`` (recipe, groups, keys; ``lr_find.*`` tunes the test). It runs with
  ``trainer.lr_find=true``, ``trainer.max_steps=lr_find.num_training``, one logging window per
  step, no checkpoints, no sanity check and one validation batch (each unless given). It prints the
  suggested ``optimizer.lr`` and writes ``lr_find.png`` and ``lr_find.json`` to the run directory
  (``outputs/lr_find/<date>`` unless ``hydra.run.dir`` says otherwise).
* ``batch_size``: the largest per-rank batch that fits (:mod:`.batch_size`), ``--max-memory-gb``
  being the limit of each rank's peak resident memory.

``--apply`` ends the output with one line, the override to use (``optimizer.lr=0.0123`` or
``data.global_batch_size=512``), for ``$(... | tail -1)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..cli import main as cli_main
from ..config import LrFindConfig

USAGE = (
    "usage: python -m ddptrain.tune lr|batch_size recipe=<name> [key=value ...] [--apply] "
    "[--max-memory-gb G (batch_size)]"
)


def lr_argv(argv: list[str]) -> list[str]:
    """``argv`` plus the overrides of a range test (those the user did not set)."""
    given = {a.split("=", 1)[0].lstrip("+~"): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    steps = given.get("lr_find.num_training", str(LrFindConfig.num_training))
    extra = {
        "trainer.lr_find": "true",
        "trainer.max_steps": steps,
        "trainer.log_every_steps": "1",
        "trainer.checkpoint.every_epochs": "0",
        "trainer.checkpoint.every_steps": "0",
        "trainer.checkpoint.at_end": "false",
        "trainer.eval_every_epochs": "0",
        "trainer.limit_val_batches": "1",
        "trainer.num_sanity_val_steps": "0",
        "trainer.smoke_check": "false",
        "trainer.early_stopping.monitor": "null",
        "hydra.run.dir": f"outputs/lr_find/{time.strftime('%Y-%m-%d_%H-%M-%S')}",
    }
    return [*argv, *(f"{k}={v}" for k, v in extra.items() if k not in given)]


def _run_cli(argv: list[str]) -> int:
    try:
        cli_main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("lr", "batch_size"):
        print(f"ddptrain.tune: error: say what to tune: lr or batch_size\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    what, rest = argv[0], argv[1:]
    apply = "--apply" in rest
    rest = [a for a in rest if a != "--apply"]
    if what == "batch_size":
        sys.exit(batch_size_main(rest, apply))
    args = lr_argv(rest)
    code = _run_cli(args)
    if code == 0 and apply:
        run_dir = Path(next(a.split("=", 1)[1] for a in reversed(args) if a.startswith("hydra.run.dir=")).strip("'\""))
        suggestion = json.loads((run_dir / "lr_find.json").read_text())["suggestion"]
        if suggestion is None:
            print("ddptrain.tune: error: no suggestion: too few steps (raise lr_find.num_training)", file=sys.stderr)
            sys.exit(1)
        print(f"optimizer.lr={suggestion:.3g}", flush=True)
    sys.exit(code)


def batch_size_main(argv: list[str], apply: bool) -> int:
    """``batch_size``: parse the search's flags, compose the config, search; the exit status
    (0 found, 1 nothing fits, 2 bad arguments)."""
    from ..cli.app import compose_config, to_config
    from ..config import ConfigError
    from ..preflight import validate
    from ..runner import run
    from .batch_size import search

    parser = argparse.ArgumentParser(prog="python -m ddptrain.tune batch_size")
    parser.add_argument("--max-memory-gb", type=float, default=None, help="limit of each rank's peak resident memory")
    parser.add_argument("--max-trials", type=int, default=12, help="per-rank batches tried: 1, 2, 4, ... (default 12)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
    options, overrides = parser.parse_known_args(argv)
    try:
        composed = compose_config(overrides)
    except Exception as exc:  # noqa: BLE001 - Hydra's composition errors: a value of the wrong type...
        print(f"ddptrain.tune: error: {exc}", file=sys.stderr)
        return 2
    try:
        config = to_config(composed, None)
        validate(config, config.dist.world_size)
        fits = search(config, run, options.max_memory_gb, options.max_trials, options.steps)
    except ConfigError as exc:
        print(f"ddptrain.tune: error: {exc}", file=sys.stderr)
        return 2
    if fits is None:
        print("ddptrain.tune: error: not even a batch of 1 per rank fits under the limit", file=sys.stderr)
        return 1
    world = config.dist.world_size
    global_batch = fits * world * config.trainer.grad_accum_steps
    print(
        f"ddptrain: batch_size: the largest per-rank batch that fits is {fits} "
        f"(data.global_batch_size={global_batch} on {world} rank(s))",
        flush=True,
    )
    if apply:
        print(f"data.global_batch_size={global_batch}", flush=True)
    return 0


if __name__ == "__main__":
    main()
