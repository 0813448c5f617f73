"""An elastic job's waits go in slices (``TorchWork`` on an abortable group, so that an abort from
the heartbeat thread ends them). A work that completes in the moment between its slice timing out
and the check after is judged by its own outcome, not by the slice's "timed out".

The race cannot be made to happen on demand with real sockets, so the c10d work here is a stand-in
that completes exactly then; everything above it is ddptrain's own code.
"""

from datetime import timedelta

import pytest

from ddptrain.comm import CommTimeoutError
from ddptrain.comm.backends.torch_c10d import TorchWork


class _WorkThatCompletesAsItsSliceEnds:
    """A c10d work whose wait(timeout) times out for ``slices`` slices; as the last one ends, the
    work completes, with ``success``."""

    def __init__(self, slices: int, success: bool):
        self.slices, self.success, self.completed = slices, success, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.slices -= 1
        if self.slices == 0:
            self.completed = True  # completes right after the slice gave up on it
        raise RuntimeError("Operation timed out!")  # what torch raises when a wait(timeout) ends first

    def is_completed(self) -> bool:
        return self.completed

    def is_success(self) -> bool:
        return self.completed and self.success


class _AbortableGroup:
    abortable = True
    abort_reason = None

    def translate_error(self, op_name, exc, seq, wait_timeout=None):
        return CommTimeoutError(f"{op_name} timed out: {exc}")


def test_a_work_that_succeeds_as_its_slice_times_out_is_a_success():
    work = TorchWork("all_gather", [], _WorkThatCompletesAsItsSliceEnds(slices=3, success=True), _AbortableGroup())
    assert work.wait(timeout=60) is True
    assert work.is_completed()


def test_a_work_that_fails_as_its_slice_times_out_is_a_failure():
    work = TorchWork("all_gather", [], _WorkThatCompletesAsItsSliceEnds(slices=3, success=False), _AbortableGroup())
    with pytest.raises(CommTimeoutError, match="all_gather"):
        work.wait(timeout=60)
