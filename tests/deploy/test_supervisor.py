"""The supervisor's mechanism at tiny sizes: the backoff policy as a pure function, and a
``Supervisor`` over short real processes (``python -c``) driven pass by pass with ``check``
and an explicit clock, so no test waits out a backoff. The state file round-trips."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from deploy.cluster_state import (
    EXITED,
    GIVEN_UP,
    RESTARTING,
    STOPPED,
    UP,
    ClusterState,
    ProcessState,
    WorkerState,
    format_state,
    read_state,
    write_state,
)
from deploy.supervision import RestartPolicy, Supervisor, describe_exit, restart_delay_s

POLICY = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0, stable_after_s=60.0, max_restarts=3, window_s=300.0)


def test_backoff_doubles_to_the_cap_and_gives_up_after_max_restarts_in_the_window():
    assert [restart_delay_s(POLICY, n, 0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert restart_delay_s(POLICY, 1, 2) == 1
    assert restart_delay_s(POLICY, 4, 3) is None
    with pytest.raises(ValueError, match="num_failures 0"):
        restart_delay_s(POLICY, 0, 0)


def test_exits_are_described_by_code_or_signal_name():
    assert describe_exit(3) == "exited with 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"


class Procs:
    """Launchers of ``python -c CODE`` processes; every one is killed and reaped at teardown."""

    def __init__(self, log_path):
        self.log_path = log_path
        self.started: list[subprocess.Popen] = []

    def launcher(self, code: str):
        def launch() -> subprocess.Popen:
            with open(self.log_path, "a") as f:
                p = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)
            self.started.append(p)
            return p

        return launch

    def close(self) -> None:
        for p in self.started:
            p.kill()
            p.wait()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path / "member.log")
    yield p
    p.close()


def wait_exit(sup: Supervisor, name: str) -> None:
    sup.procs()[name].wait(timeout=30)


def test_a_crash_loop_is_reported_restarted_with_backoff_then_given_up(procs):
    events = []
    sup = Supervisor(restart=True, policy=POLICY, on_event=events.append)
    sup.add("w", "decode", procs.launcher("import sys; print('line one'); print('boom'); sys.exit(3)"),
            procs.log_path)
    now = time.monotonic()
    for restart in range(1, POLICY.max_restarts + 1):
        wait_exit(sup, "w")
        [crash] = sup.check(now)
        assert (crash.kind, crash.exit) == ("crashed", "exited with 3")
        assert crash.log_tail[-1] == "boom" and "boom" in crash.report
        delay = 2 ** (restart - 1)
        assert f"restarting in {delay} s" in crash.detail
        assert sup.states()[0].status == RESTARTING
        assert sup.check(now + delay - 0.01) == []  # still backing off
        now += delay
        [restarted] = sup.check(now)
        assert restarted.kind == "restarted" and sup.states()[0].restarts == restart
    wait_exit(sup, "w")
    [given_up] = sup.check(now)
    assert given_up.kind == "given-up" and "3 restarts within 300 s" in given_up.detail
    state = sup.states()[0]
    assert (state.status, state.restarts, state.last_exit) == (GIVEN_UP, 3, "exited with 3")
    assert sup.check(now + 1000) == []  # given up: it stays down
    assert events == sup.events and len(events) == 2 * POLICY.max_restarts + 1


def test_a_run_longer_than_stable_after_resets_the_backoff(procs):
    sup = Supervisor(restart=True, policy=POLICY)
    sup.add("w", "prefill", procs.launcher("import sys; sys.exit(1)"), procs.log_path)
    now = time.monotonic()
    wait_exit(sup, "w")
    assert "restarting in 1 s" in sup.check(now)[0].detail
    sup.check(now + 1)
    wait_exit(sup, "w")
    assert "restarting in 2 s" in sup.check(now + 1)[0].detail  # crashed at once: doubled
    sup.check(now + 3)
    wait_exit(sup, "w")
    assert "restarting in 1 s" in sup.check(now + 3 + POLICY.stable_after_s)[0].detail


def test_expected_exits_and_exit_zero_are_not_restarted(procs):
    sup = Supervisor(restart=True, policy=POLICY)
    sup.add("a", "decode", procs.launcher("import time; time.sleep(60)"))
    sup.add("b", "decode", procs.launcher("pass"))
    sup.expect_exit("a")
    sup.procs()["a"].kill()
    wait_exit(sup, "a")
    wait_exit(sup, "b")
    events = {e.name: e for e in sup.check(time.monotonic())}
    assert (events["a"].kind, events["a"].exit) == ("stopped", "killed by SIGKILL")
    assert (events["b"].kind, events["b"].exit) == ("exited", "exited with 0")
    assert {s.name: s.status for s in sup.states()} == {"a": STOPPED, "b": EXITED}
    assert sup.check(time.monotonic() + 1000) == []


def test_without_restart_a_crash_is_reported_only(procs):
    sup = Supervisor(restart=False, policy=POLICY)
    sup.add("w", "decode", procs.launcher("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    wait_exit(sup, "w")
    [event] = sup.check(time.monotonic())
    assert (event.kind, event.exit) == ("crashed", "killed by SIGKILL") and "not restarted" in event.detail
    assert sup.states()[0].status == EXITED


def test_replace_restarts_at_once_as_a_stop_not_a_crash(procs):
    sup = Supervisor(restart=True, policy=POLICY)
    sup.add("c", "conductor", procs.launcher("import time; time.sleep(60)"))
    old = sup.procs()["c"]
    sup.replace("c")
    assert old.returncode == -signal.SIGKILL and sup.procs()["c"] is not old
    assert sup.events[-1].kind == "restarted" and "on request" in sup.events[-1].detail
    assert sup.check(time.monotonic()) == []  # the killed one is not seen as a crash
    assert sup.states()[0].status == UP


def test_the_thread_notices_an_exit_by_itself(procs):
    sup = Supervisor(restart=False, policy=RestartPolicy(poll_interval_s=0.05))
    sup.add("w", "decode", procs.launcher("import time; time.sleep(60)"))
    sup.start()
    try:
        sup.procs()["w"].kill()
        until = time.monotonic() + 30
        while not sup.events and time.monotonic() < until:
            time.sleep(0.05)
    finally:
        sup.stop()
    assert [e.exit for e in sup.events] == ["killed by SIGKILL"]


def test_state_file_round_trips_and_renders(tmp_path):
    state = ClusterState("127.0.0.1:1", "http://127.0.0.1:8/v1", str(tmp_path / "logs"), 42, time.time(),
                         (ProcessState("decode-0", "decode", 7, UP, 2, time.time() - 75, "killed by SIGKILL"),),
                         (WorkerState("decode-0", "decode", "127.0.0.1:9", 0, 1, 10, 12, 33, "tcp://127.0.0.1:5",
                                      "127.0.0.1:6"),), "", "127.0.0.1:2")
    path = tmp_path / "state.json"
    write_state(path, state)
    write_state(path, state)  # replaces, leaving no temp file
    assert read_state(path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    text = format_state(state, time.time())
    lines = text.splitlines()
    assert lines[1].split() == ["PROCESS", "ROLE", "PID", "STATUS", "RESTARTS", "UPTIME", "LAST", "EXIT"]
    assert lines[2].split() == ["decode-0", "decode", "7", "up", "2", "1m15s", "killed", "by", "SIGKILL"]
    assert lines[4].split() == ["decode-0", "decode", "0", "1", "10/12", "33", "127.0.0.1:9"]
    assert [line.split() for line in lines[5:9]] == [
        ["ROLE", "WORKER", "GRPC", "TRANSFER", "METRICS", "HTTP"],
        ["conductor", "-", "127.0.0.1:1", "-", "127.0.0.1:2", "-"],
        ["decode", "decode-0", "127.0.0.1:9", "tcp://127.0.0.1:5", "127.0.0.1:6", "-"],
        ["http", "-", "-", "-", "127.0.0.1:8", "http://127.0.0.1:8/v1"]]
    old = json.loads(path.read_text())  # a state file written before the addresses were kept
    del old["conductor_metrics"], old["workers"][0]["transfer_address"], old["workers"][0]["metrics_address"]
    path.write_text(json.dumps(old))
    assert read_state(path).workers[0].rpc_address == "127.0.0.1:9"
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a version-1 cluster state file"):
        read_state(path)
