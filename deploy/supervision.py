"""Supervising local processes: notice an exit at once, report it, restart with backoff.

``Supervisor`` owns one record per member process (how to launch it, the live ``Popen``,
its status and restarts) and one thread that checks them every ``poll_interval_s``. An exit
it was not told to expect is reported (a ``ProcessEvent`` with the exit code or signal name
and the last lines of the process's log, logged and handed to ``on_event``) and, when the
supervisor restarts, followed by a new process after the backoff that the pure
``restart_delay_s`` picks from the restart history. Expected exits (``expect_exit``,
``replace``) are reported as stopped and never restarted; so is an exit 0, which a
``tidekv serve`` process makes only after draining on a SIGTERM/SIGINT someone sent it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy.cluster_state import EXITED, GIVEN_UP, RESTARTING, STOPPED, UP, ProcessState

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # A process that stayed up this long before it crashed starts again from initial_backoff_s.
    stable_after_s: float = 60.0
    # A crash loop: once max_restarts restarts happened within window_s, the next crash gives up.
    max_restarts: int = 5
    window_s: float = 300.0
    # How soon an exit is noticed: waitpid has no event to wait on, so the thread polls.
    poll_interval_s: float = 0.2


def restart_delay_s(policy: RestartPolicy, num_failures: int, num_recent_restarts: int) -> float | None:
    """Seconds to wait before restarting a process that just crashed, or None to give up.
    ``num_failures``: consecutive crashes including this one (>= 1; a stable run resets it);
    ``num_recent_restarts``: restarts within the last ``policy.window_s``."""
    if num_failures < 1:
        raise ValueError(f"num_failures {num_failures} < 1: call this for a crash")
    if num_recent_restarts >= policy.max_restarts:
        return None
    return min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** min(num_failures - 1, 32))


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def log_tail(path: Path | None, num_lines: int = LOG_TAIL_LINES, max_bytes: int = 16384) -> tuple[str, ...]:
    """The last ``num_lines`` lines of the file (read from its last ``max_bytes``); () if none."""
    if path is None or not path.exists():
        return ()
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - max_bytes))
        text = f.read().decode("utf-8", "replace")
    return tuple(text.splitlines()[-num_lines:])


@dataclass(frozen=True)
class ProcessEvent:
    """Something that happened to a member: kind is crashed, given-up, exited, stopped or restarted."""

    kind: str
    name: str
    role: str
    pid: int
    exit: str  # describe_exit of the exit, "" for restarted
    detail: str  # what the supervisor does about it
    log_tail: tuple[str, ...] = ()
    time_s: float = field(default_factory=time.time)

    @property
    def report(self) -> str:
        head = f"{self.name} ({self.role}, pid {self.pid}) {self.exit}{'; ' if self.exit else ''}{self.detail}"
        if not self.log_tail:
            return head
        return "\n".join([head, f"  last {len(self.log_tail)} lines of its log:",
                          *(f"  | {line}" for line in self.log_tail)])


@dataclass
class _Member:
    """One supervised process; every field is guarded by the Supervisor's lock."""

    name: str
    role: str
    launch: Callable[[], subprocess.Popen]
    log_path: Path | None
    proc: subprocess.Popen
    started_at_s: float = field(default_factory=time.time)
    started_mono_s: float = field(default_factory=time.monotonic)
    status: str = UP
    restarts: int = 0
    num_failures: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    last_exit: str = ""
    restart_at: float = 0.0
    exit_expected: bool = False

    def state(self) -> ProcessState:
        return ProcessState(self.name, self.role, self.proc.pid, self.status, self.restarts,
                            self.started_at_s, self.last_exit)


class Supervisor:
    """Watches member processes from one thread. ``restart``: restart crashed members (else
    they are only reported). ``on_event(event)`` and ``on_change()`` run on the supervisor's
    thread (or the caller's, for ``replace`` and ``mark_stopped``) outside its lock, after
    every event; they must not block for long."""

    def __init__(self, restart: bool, policy: RestartPolicy = RestartPolicy(),
                 on_event: Callable[[ProcessEvent], None] | None = None,
                 on_change: Callable[[], None] | None = None):
        self.restart = restart
        self.policy = policy
        self._on_event = on_event
        self._on_change = on_change
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._events: deque[ProcessEvent] = deque(maxlen=1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, role: str, launch: Callable[[], subprocess.Popen], log_path: Path | None = None) -> None:
        """Launches a member now (``launch()`` starts its process) and supervises it."""
        proc = launch()
        with self._lock:
            assert name not in self._members, name
            self._members[name] = _Member(name, role, launch, log_path, proc)
        self._changed([])

    def procs(self) -> dict[str, subprocess.Popen]:
        """Each member's current process (a new one after a restart)."""
        with self._lock:
            return {name: m.proc for name, m in self._members.items()}

    def states(self) -> tuple[ProcessState, ...]:
        with self._lock:
            return tuple(m.state() for m in self._members.values())

    @property
    def events(self) -> list[ProcessEvent]:
        """Every event so far (the last 1000), oldest first."""
        with self._lock:
            return list(self._events)

    def expect_exit(self, name: str) -> None:
        """The current process of ``name`` is about to be stopped on purpose: its exit is
        reported as stopped and it is not restarted."""
        with self._lock:
            self._members[name].exit_expected = True

    def replace(self, name: str, down_s: float = 0.0) -> None:
        """SIGKILLs member ``name``, waits for it and launches it again ``down_s`` later (no
        backoff). Holds the supervisor's lock throughout, so no other member is watched or
        restarted during ``down_s`` (a test's outage of seconds)."""
        with self._lock:
            m = self._members[name]
            m.exit_expected = True
            m.proc.kill()
            m.last_exit = describe_exit(m.proc.wait())
            time.sleep(down_s)
            old_pid = m.proc.pid
            self._relaunch(m)
            event = ProcessEvent("restarted", name, m.role, m.proc.pid, "",
                                 f"restarted on request (pid {old_pid} {m.last_exit})")
            self._events.append(event)
        self._changed([event])

    def start(self) -> None:
        assert self._thread is None, "started twice"
        self._thread = threading.Thread(target=self._run, name="tidekv-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops watching (idempotent): nothing is reported or restarted after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mark_stopped(self) -> None:
        """After the owner stopped every process: each member is stopped, with its exit."""
        with self._lock:
            for m in self._members.values():
                m.status = STOPPED
                if m.proc.returncode is not None:
                    m.last_exit = describe_exit(m.proc.returncode)
        self._changed([])

    def _run(self) -> None:
        while not self._stop.wait(self.policy.poll_interval_s):
            self.check()

    def check(self, now: float | None = None) -> list[ProcessEvent]:
        """One pass: reports members that exited, relaunches those whose backoff is over."""
        now = time.monotonic() if now is None else now
        events = []
        with self._lock:
            for m in self._members.values():
                if m.status == RESTARTING and now >= m.restart_at:
                    old_pid = m.proc.pid
                    self._relaunch(m)
                    m.restart_times.append(now)
                    events.append(ProcessEvent("restarted", m.name, m.role, m.proc.pid, "",
                                               f"restarted (restart {m.restarts}; pid {old_pid} {m.last_exit})"))
                elif m.status == UP and m.proc.poll() is not None:
                    events.append(self._exited(m, now))
            self._events.extend(events)
        if events:
            self._changed(events)
        return events

    def _relaunch(self, m: _Member) -> None:
        m.proc = m.launch()
        m.restarts += 1
        m.started_at_s, m.started_mono_s = time.time(), time.monotonic()
        m.status, m.exit_expected = UP, False

    def _exited(self, m: _Member, now: float) -> ProcessEvent:
        """Decides what a member's exit means and records it (the lock is held)."""
        rc = m.proc.returncode
        m.last_exit = describe_exit(rc)
        uptime_s = now - m.started_mono_s
        up_for = f"after {uptime_s:.1f} s up"
        if m.exit_expected:
            m.status = STOPPED
            return ProcessEvent("stopped", m.name, m.role, m.proc.pid, m.last_exit, f"{up_for}, stopped on purpose")
        tail = log_tail(m.log_path)
        if rc == 0:
            m.status = EXITED
            return ProcessEvent("exited", m.name, m.role, m.proc.pid, m.last_exit,
                                f"{up_for} (drained after a signal from outside the cluster); not restarted", tail)
        if not self.restart:
            m.status = EXITED
            return ProcessEvent("crashed", m.name, m.role, m.proc.pid, m.last_exit,
                                f"{up_for}; not restarted (supervision is off)", tail)
        m.num_failures = 1 if uptime_s >= self.policy.stable_after_s else m.num_failures + 1
        while m.restart_times and now - m.restart_times[0] >= self.policy.window_s:
            m.restart_times.popleft()
        delay_s = restart_delay_s(self.policy, m.num_failures, len(m.restart_times))
        if delay_s is None:
            m.status = GIVEN_UP
            return ProcessEvent("given-up", m.name, m.role, m.proc.pid, m.last_exit,
                                f"{up_for}; {len(m.restart_times)} restarts within {self.policy.window_s:g} s: "
                                f"a crash loop, giving up (it stays down)", tail)
        m.status, m.restart_at = RESTARTING, now + delay_s
        return ProcessEvent("crashed", m.name, m.role, m.proc.pid, m.last_exit,
                            f"{up_for}; restarting in {delay_s:g} s", tail)

    def _changed(self, events: list[ProcessEvent]) -> None:
        for event in events:
            level = logging.INFO if event.kind in ("stopped", "restarted", "exited") else logging.WARNING
            log.log(level, "%s", event.report)
            if self._on_event is not None:
                self._on_event(event)
        if self._on_change is not None:
            self._on_change()
