"""Stacks on request: ``SIGUSR1`` makes a rank append every thread's Python stack to
``<ledger dir>/rank<N>.stack``, which :mod:`ddptrain.comm.forensics` reads to say where a rank
that never arrived is now.

Why not ``faulthandler.register(SIGUSR1, all_threads=True)`` (what this module replaced): it
walks the other threads' frames from inside the signal handler, without the GIL, and a thread
that runs Python meanwhile frees those frames under it. The mpi backend's communication thread
polls in Python, so a rank asked for its stack while it waited died of SIGSEGV (about one launch
in two of the comm-error tests; a thread calling a function in a loop crashes faulthandler
within three requests).

Here the signal only wakes a dumper thread: the C-level handler writes the signal number to a
pipe (``signal.set_wakeup_fd``) whatever thread it interrupted, and the dumper, which holds the
GIL while it reads ``sys._current_frames()``, sees consistent frames. That answers for a main
thread in ``time.sleep``, a lock, a DataLoader queue, an endless Python loop or a C call that
releases the GIL. A thread that holds the GIL forever leaves the request unanswered (the
requester then reports "no stack received"), never a crash.

If the process already uses a wakeup fd (asyncio's signal handlers), the dump runs as an
ordinary Python signal handler in the main thread instead (same output, answered when the main
thread next runs Python). Outside the main thread neither can be installed: faulthandler is the
fallback there, hazard included.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

_state = {"path": None, "pipe": None}


def stack_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stack"


def enable_stack_dumps(directory: str | Path, rank: int) -> None:
    """Make ``SIGUSR1`` append every thread's Python stack to ``<directory>/rank<N>.stack``
    (again with another directory: later dumps go there)."""
    _state["path"] = stack_path(directory, rank)
    if threading.current_thread() is not threading.main_thread():
        _use_faulthandler()
        return
    if _state["pipe"] is None:
        _start_dumper()
    else:
        signal.signal(signal.SIGUSR1, _wake_only)


def format_stacks() -> str:
    """Every thread's stack but the caller's, in faulthandler's format (most recent call first),
    the main thread first."""
    frames = sys._current_frames()
    me = threading.get_ident()
    main = threading.main_thread().ident
    blocks = []
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == me and ident != main:
            continue  # the dumper thread
        lines = [f"Thread 0x{ident:016x} (most recent call first):"]
        frame = frames[ident]
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back  # a dump made in the main thread's handler: start at the code it interrupted
        while frame is not None:
            lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
            frame = frame.f_back
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n"


def _write_stacks() -> None:
    path = _state["path"]
    if path is None:
        return
    text = format_stacks().encode(errors="replace")
    try:  # one append: two requests at once give two whole dumps, never interleaved lines
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
    except OSError:
        pass  # the run directory is gone: nobody is waiting for this dump


def _wake_only(signum, frame) -> None:
    """The Python-level handler: a no-op (its C half already woke the dumper through the pipe)."""


def _dump_in_handler(signum, frame) -> None:
    _write_stacks()


def _start_dumper() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd requires it: a signal handler never blocks
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:
        previous = -2
    if previous != -1:  # someone else's wakeup fd (or none allowed): keep theirs, dump in the handler
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        signal.signal(signal.SIGUSR1, _dump_in_handler)
        return
    _state["pipe"] = (read_end, write_end)
    signal.signal(signal.SIGUSR1, _wake_only)
    threading.Thread(target=_dumper, args=(read_end,), name="ddptrain-stack-dumper", daemon=True).start()
    os.register_at_fork(after_in_child=_forget_in_child)


def _dumper(read_end: int) -> None:
    while True:
        try:
            got = os.read(read_end, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGUSR1 in got:  # every handled signal writes its number; only SIGUSR1 asks for a dump
            _write_stacks()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has no dumper thread: it must not write to the
    parent's pipe, nor claim the parent's stack file."""
    if _state["pipe"] is None:
        return
    _state["pipe"], _state["path"] = None, None
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    except ValueError:
        pass


def _use_faulthandler() -> None:
    import faulthandler

    handle = open(_state["path"], "a")  # noqa: SIM115 - stays open: faulthandler writes to its descriptor
    _state["faulthandler_file"] = handle
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True, chain=False)
