"""How a role's process waits for its stop signal (``runtime.service.wait_for_signal``): a
SIGTERM that the kernel hands to another thread than the main one still stops it. A child
process waits as every role's ``serve`` does; one of its other threads takes the SIGTERM
(thread-directed, as the kernel may choose any thread for a process-directed one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import signal, threading
from runtime.service import wait_for_signal

def take_it():  # this thread, not the main one, receives the SIGTERM
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Timer(0.5, take_it).start()
wait_for_signal("waiting")
print("stopped", flush=True)
"""


def test_a_sigterm_taken_by_another_thread_still_stops_the_wait():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=30)  # an untimed wait sleeps through it for good
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0 and out.split() == ["waiting", "stopped"], (child.returncode, out)
