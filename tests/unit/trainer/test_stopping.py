"""GracefulStop's signal handlers, in this process: the first SIGINT/SIGTERM asks to stop, a second
one a moment later (SECOND_SIGNAL_AFTER_S) raises KeyboardInterrupt as Python's default handler
would, one that comes sooner (the same keypress reaching the process twice) is ignored; uninstall
gives the handlers back."""

import signal
import time

import pytest

from ddptrain.launch.signals import SECOND_SIGNAL_AFTER_S
from ddptrain.trainer.stopping import GracefulStop


@pytest.fixture
def previous_handlers():
    """Handlers of our own under GracefulStop's: a signal it failed to take over lands in
    ``received`` instead of interrupting the test session. The originals are put back after."""
    received = []

    def record(signum, frame):
        received.append(signal.Signals(signum).name)

    originals = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield record, received
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)


def _send(sig):
    """The signal to this process, from this (the main) thread: its Python handler has run on return."""
    signal.raise_signal(sig)


def _send_not_interrupting(sig):
    """As _send; a KeyboardInterrupt is this test's failure (not the end of the whole pytest session)."""
    try:
        _send(sig)
    except KeyboardInterrupt as exc:
        pytest.fail(f"{signal.Signals(sig).name} raised KeyboardInterrupt({exc}): it must not interrupt now")


@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)])
def test_a_second_signal_raises_keyboard_interrupt_only_a_moment_after_the_first(previous_handlers, first, second):
    record, received = previous_handlers
    stop = GracefulStop()
    stop.install()
    try:
        _send_not_interrupting(first)
        assert stop.requested == signal.Signals(first).name and received == []  # asked to stop, not interrupted
        assert stop.votes(False) == ([1.0, 0.0, 0.0, 0.0] if first == signal.SIGINT else [0.0, 1.0, 0.0, 0.0])
        _send_not_interrupting(second)  # at once: the same keypress twice (terminal and launcher), ignored
        assert stop.requested == signal.Signals(first).name and received == []
        time.sleep(SECOND_SIGNAL_AFTER_S + 0.05)
        with pytest.raises(KeyboardInterrupt):
            _send(second)
        assert stop.requested == signal.Signals(first).name  # the first signal still decides the vote
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is record and signal.getsignal(signal.SIGTERM) is record
    _send_not_interrupting(signal.SIGINT)  # after uninstall: the previous handler's again
    assert received == ["SIGINT"]


def test_max_time_votes_once_its_clock_passes_and_a_signal_after_it_is_a_first_signal(previous_handlers):
    stop = GracefulStop(max_time_s=0.2)
    stop.install()
    try:
        assert stop.votes(False) == [0.0, 0.0, 0.0, 0.0] and stop.requested is None
        time.sleep(0.25)
        assert stop.votes(True) == [0.0, 0.0, 1.0, 1.0] and stop.requested == "max_time"
        assert GracefulStop.decide([0.0, 0.0, 1.0, 0.0]) == ("max_time", False)
        assert GracefulStop.decide([0.0, 2.0, 1.0, 0.0]) == ("SIGTERM", False)  # a signal wins over the clock
        _send_not_interrupting(signal.SIGINT)  # the user's Ctrl-C after the limit: a stop, not an interrupt
        assert stop.requested == "SIGINT"
    finally:
        stop.uninstall()


def test_second_signal_after_s_is_a_moment():
    """Long enough for one keypress that reaches a process twice, short enough for a person's second Ctrl-C."""
    assert 0.1 <= SECOND_SIGNAL_AFTER_S <= 5.0


def test_uninstall_restores_the_handlers_that_were_there_before(previous_handlers):
    record, _ = previous_handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stop = GracefulStop()
    stop.install()
    assert signal.getsignal(signal.SIGINT) not in (record, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) not in (record, signal.SIG_DFL)
    stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is record and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    stop.uninstall()  # twice: nothing more to give back
    assert signal.getsignal(signal.SIGINT) is record


def test_in_an_elastic_job_under_another_launcher_sigterm_leaves_the_job_and_sigint_stops_it(previous_handlers):
    """torchrun SIGTERMs a host's workers to restart them: that member leaves at once (the others go
    on without it); Ctrl-C keeps its meaning, a vote to stop the job after the current step."""
    from ddptrain.launch.signals import StoppedBySignal

    stop = GracefulStop(sigterm_leaves=True)
    stop.install()
    try:
        with pytest.raises(StoppedBySignal, match="the elastic job goes on with the others") as left:
            _send(signal.SIGTERM)
        assert left.value.signal_name == "SIGTERM" and stop.requested is None
        _send_not_interrupting(signal.SIGINT)
        assert stop.requested == "SIGINT"
    finally:
        stop.uninstall()
    assert previous_handlers[1] == []
