"""Stack dumps on SIGUSR1 (``ddptrain.comm.stacks``): answered, complete, and never fatal.

Each test runs a real child process and signals it from outside, as the forensics of a peer rank
or ``python -m ddptrain.dump`` do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ddptrain.comm import forensics

pytestmark = pytest.mark.timeout(60)

# Threads that call functions in a loop push and pop frames all the time (as the mpi backend's
# polling thread does) while the main thread waits on a lock. faulthandler's all-thread dump,
# which read those frames without the GIL, died of SIGSEGV here within three requests.
CHURNING = """
import sys, threading
from ddptrain.comm.stacks import enable_stack_dumps

enable_stack_dumps(sys.argv[1], 3)


def deep(n):
    return 0 if n == 0 else deep(n - 1) + 1


def churn():
    while True:
        deep(400)


for _ in range(2):
    threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)


def wait_here():
    threading.Event().wait(60)


wait_here()
"""


def _start(tmp_path, source: str) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _where(stack_text: str) -> str:
    """forensics' "file:line in function: `source`" for the main thread, the file's directory cut."""
    return forensics.where(forensics.main_stack(stack_text)).split("/")[-1]


def test_many_requests_while_other_threads_run_python_never_crash_the_rank(tmp_path):
    proc = _start(tmp_path, CHURNING)
    try:
        time.sleep(0.3)  # into wait_here
        for _ in range(300):
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.002)
        time.sleep(0.5)
        assert proc.poll() is None, f"the rank died answering stack requests: exit {proc.returncode}"
        text = (tmp_path / "rank3.stack").read_text()
        # the last answer names the main thread's wait and the churning threads' function (each
        # answer starts with the main thread's header)
        frames = forensics.main_stack(text[text.rindex(text.splitlines()[0]) :])
        assert "child.py:23 in wait_here" in forensics.where(frames), forensics.where(frames)
        assert "in deep" in text and text.count("(most recent call first):") >= 3
    finally:
        proc.kill()
        proc.wait(10)


def test_a_request_while_the_main_thread_sleeps_is_answered_at_once(tmp_path):
    proc = _start(
        tmp_path,
        """
        import sys, time
        from ddptrain.comm.stacks import enable_stack_dumps
        enable_stack_dumps(sys.argv[1], 0)
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    try:
        time.sleep(0.3)  # into the sleep
        t0 = time.monotonic()
        stacks = forensics.request_stacks(tmp_path, {0: proc.pid}, wait_s=5)
        assert time.monotonic() - t0 < 1.5
        assert _where(stacks[0]) == "child.py:6 in <module>: `time.sleep(60)`"
        assert "ddptrain-stack-dumper" not in stacks[0] and "_dumper" not in stacks[0]  # the dumper is left out
    finally:
        proc.kill()
        proc.wait(10)


def test_a_program_with_its_own_wakeup_fd_keeps_it_and_still_answers(tmp_path):
    proc = _start(
        tmp_path,
        """
        import os, signal, sys, time
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        from ddptrain.comm.stacks import enable_stack_dumps
        enable_stack_dumps(sys.argv[1], 0)
        assert signal.set_wakeup_fd(w) == w, "ddptrain replaced the program's wakeup fd"
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    try:
        time.sleep(0.3)
        stacks = forensics.request_stacks(tmp_path, {0: proc.pid}, wait_s=5)
        assert _where(stacks[0]) == "child.py:10 in <module>: `time.sleep(60)`"
    finally:
        proc.kill()
        proc.wait(10)
