"""``CoreWait``: the time the training thread waited for a core, read from Linux's scheduler
statistics through a file kept open — a stale read (0 for every step) would hide oversubscription."""

import multiprocessing
import os
import time

import pytest

from ddptrain.doctor.measure import CoreWait

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux schedstat")


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def test_a_thread_sharing_its_core_with_a_busy_process_is_seen_waiting():
    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    ctx = multiprocessing.get_context("fork")
    rival = ctx.Process(target=_spin, args=(time.monotonic() + 5.0,))
    os.sched_setaffinity(0, {cpu})  # this thread and the rival (it inherits the mask) on one core
    try:
        rival.start()
        clock = CoreWait()
        time.sleep(0.2)  # the rival is running
        before, started = clock.seconds(), time.perf_counter()
        _spin(time.monotonic() + 1.0)  # wants the core the whole second: gets about half of it
        waited, wall = clock.seconds() - before, time.perf_counter() - started
        clock.close()
    finally:
        os.sched_setaffinity(0, saved)
        rival.terminate()
        rival.join(10)
    assert waited > 0.2 * wall, f"waited {waited:.3f} s of {wall:.3f} s beside a busy process on one core"
    assert clock.seconds() == 0.0  # closed: no file, no reading
