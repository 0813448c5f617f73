"""torch's own DDP tests, from the installed wheel, run against a chosen DistributedDataParallel.

torch ships its distributed test suite in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``, ``DistributedTest._DistTestBase``).
This module imports it (nothing is copied), swaps the DDP class it uses, and defines one
``unittest`` case class that runs its tests over gloo, one process per rank.

Which class is tested comes from the environment, read once at import, before torch's suite is
imported (it binds ``DistributedDataParallel`` at import time):

* ``DDPTRAIN_SUITE_DDP=ours`` (the default) — ``ddptrain.ddp.DistributedDataParallel`` replaces
  ``torch.nn.parallel.DistributedDataParallel`` and the suite module's own name for it;
* ``DDPTRAIN_SUITE_DDP=torch`` — torch's class, untouched: the reference verdicts.

``BACKEND`` (gloo), ``WORLD_SIZE`` (2) and ``TEMP_DIR`` are what torch's suite reads; they get
defaults here. ``scripts/torch_ddp_suite.py`` runs this module for both classes and prints the
verdicts side by side; ``tests/conformance/test_torch_suite.py`` runs the CPU subset in the suite.
"""

from __future__ import annotations

import os
import re
import tempfile

IMPL = os.environ.setdefault("DDPTRAIN_SUITE_DDP", "ours")
if IMPL not in ("ours", "torch"):
    raise SystemExit(f"DDPTRAIN_SUITE_DDP={IMPL!r}: use 'ours' or 'torch'")
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="ddptrain-torch-suite-"))

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402

if IMPL == "ours":
    from ddptrain.ddp import DistributedDataParallel as _Ours

    torch.nn.parallel.DistributedDataParallel = _Ours  # what the tests reach as nn.parallel.<name>

from torch.testing._internal.distributed import distributed_test  # noqa: E402

if IMPL == "ours":
    distributed_test.DistributedDataParallel = _Ours  # the suite's own `from ... import` binding

DDP_TEST = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)
"""A test of DDP, by its name (torch names them so: ``test_ddp_*``, ``test_DistributedDataParallel*``)."""


def ddp_test_names() -> list[str]:
    """The DDP tests of the installed wheel's suite, sorted."""
    names = dir(distributed_test.DistributedTest._DistTestBase)
    return sorted(name for name in names if name.startswith("test_") and DDP_TEST.search(name))


class TorchDistributedSuite(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """torch's ``_DistTestBase`` over gloo; each test forks one process per rank.

    Fork, not spawn (torch's own runner spawns): the ranks inherit the DDP swap and skip the ~3 s
    import of torch each test would otherwise pay twice. The parent has run no collective and holds
    no CUDA context, so a fork is safe here.
    """

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)
