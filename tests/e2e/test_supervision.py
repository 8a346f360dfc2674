"""A supervised cluster: a worker that dies is reported (naming the signal, with its log's
last lines), started again, registers again and serves; one stopped on purpose stays down;
`tidekv up` says so on stderr, `tidekv status` shows the restart, SIGUSR1 prints the state,
and the logs (appended to at every start) outlive the cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import engine
from conductor.client import Client
from deploy.cluster_state import read_state
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120


def wait_for(what, timeout_s: float = DEADLINE_S):
    """Polls ``what()`` until it returns something truthy; fails the test after ``timeout_s``."""
    until = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < until, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(0.1)
    return value


def first(events, kind: str, name: str):
    return next((e for e in events if e.kind == kind and e.name == name), None)


def test_killed_decode_worker_is_reported_restarted_reregistered_and_serves(reference, tmp_path):
    events = []
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                           supervise=True, data_dir=str(tmp_path))
    cluster = LocalCluster(config, on_event=events.append)
    try:
        cluster.start()
        old_address = {w.worker_id: w.rpc_address for w in cluster.workers().workers}["decode-0"]
        victim = cluster.procs["decode-0"]
        os.kill(victim.pid, signal.SIGKILL)  # a crash: from outside the cluster's own API
        crash = wait_for(lambda: first(events, "crashed", "decode-0"))
        assert (crash.pid, crash.exit) == (victim.pid, "killed by SIGKILL")
        assert "restarting in 1 s" in crash.detail and crash.log_tail and "killed by SIGKILL" in crash.report
        wait_for(lambda: first(events, "restarted", "decode-0"))
        assert cluster.procs["decode-0"].pid != victim.pid

        def reregistered():
            """decode-0 registered from its new process's address"""
            return {w.worker_id: w.rpc_address for w in cluster.workers().workers}.get("decode-0") not in (
                None, old_address)

        wait_for(reregistered)
        ids = prompt(40, 1100)
        out = run_all(cluster.endpoint, [Client.request(ids, max_tokens=8)])[0]
        assert out.decode_worker == "decode-0" and out.token_ids == engine.generate(reference, ids, 8)
        state = {p.name: p for p in read_state(cluster.state_file).processes}
        assert (state["decode-0"].status, state["decode-0"].restarts) == ("up", 1)
        assert state["decode-0"].last_exit == "killed by SIGKILL" and state["prefill-0"].restarts == 0

        cluster.kill("decode-0")  # on purpose: stopped, not restarted
        stopped = wait_for(lambda: first(events, "stopped", "decode-0"))
        assert stopped.exit == "killed by SIGKILL"
        assert {p.name: p.status for p in cluster.state().processes}["decode-0"] == "stopped"
    finally:
        cluster.stop()
    assert [e.kind for e in events if e.name == "decode-0"] == ["crashed", "restarted", "stopped"]
    log = (cluster.log_dir / "decode-0.log").read_text()
    assert log.count("starting decode-0: tidekv serve --role decode") == 2  # appended, not truncated
    assert cluster.log_dir == tmp_path / "logs"  # a given data dir keeps the logs and the final state
    assert {p.status for p in read_state(cluster.state_file).processes} == {"stopped"}


class Stream:
    """A pipe read line by line on a thread, so the test can wait for a line."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(pipe), daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def join(self) -> None:
        self._thread.join(30)


def tidekv_status(env, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "status", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_up_restarts_a_killed_worker_and_reports_it_and_its_state(tmp_path, reference):
    # No --data-dir: the logs and the state go to ~/.cache/tidekv/up/<run>, here under a fresh HOME.
    env = {**os.environ, "HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--port", "0", "--http-port", "-1",
                             "--policy", "round_robin"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = Stream(proc.stdout), Stream(proc.stderr)
    try:
        wait_for(lambda: "tidekv cluster ready" in out.text or proc.poll() is not None)
        assert "tidekv cluster ready" in out.text, err.text[-3000:]
        [run] = (tmp_path / ".cache" / "tidekv" / "up").iterdir()
        assert f"logs in {run / 'logs'}; state in {run / 'state.json'}" in err.text
        state = read_state(run / "state.json")
        victim = {p.name: p for p in state.processes}["decode-0"]
        old_address = {w.worker_id: w.rpc_address for w in state.workers}["decode-0"]
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: f"decode-0 (decode, pid {victim.pid}) killed by SIGKILL" in err.text)

        def reregistered():
            """the state file shows decode-0 restarted and registered from its new address"""
            s = read_state(run / "state.json")
            p = {p.name: p for p in s.processes}["decode-0"]
            address = {w.worker_id: w.rpc_address for w in s.workers}.get("decode-0")
            return p.restarts == 1 and p.status == "up" and address not in (None, old_address)

        wait_for(reregistered)
        ids = prompt(30, 1200)
        done = Client(state.endpoint).generate(Client.request(ids, max_tokens=6))
        assert done.token_ids == engine.generate(reference, ids, 6)

        as_json = json.loads(tidekv_status(env, "--json"))  # the newest run under HOME's cache
        decode = {p["name"]: p for p in as_json["processes"]}["decode-0"]
        assert (decode["restarts"], decode["status"], decode["last_exit"]) == (1, "up", "killed by SIGKILL")
        text = tidekv_status(env, "--state", str(run / "state.json"))
        processes = text.split("\nPROCESS", 1)[1].split("\nWORKER", 1)[0]  # the process table
        rows = {line.split()[0]: line.split() for line in processes.splitlines()[1:]}
        assert rows["decode-0"][3:5] == ["up", "1"] and rows["conductor"][3:5] == ["up", "0"]

        pid = {p.name: p for p in read_state(run / "state.json").processes}["decode-0"].pid
        mark = len(err.text)
        proc.send_signal(signal.SIGUSR1)

        def printed():
            """the SIGUSR1 state on stderr: the restarted process and the registered worker's load"""
            rows = [line.split() for line in err.text[mark:].splitlines()]
            return (["decode-0", "decode", str(pid), "up", "1"] in [r[:5] for r in rows]
                    and any(r[:2] == ["decode-0", "decode"] and "/" in r[4] for r in rows if len(r) > 4))

        wait_for(printed)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        out.join()
        err.join()
    assert proc.returncode == 0, err.text[-3000:]
    logs = run / "logs"
    assert {p.name for p in logs.iterdir()} >= {"conductor.log", "prefill-0.log", "decode-0.log"}
    assert (logs / "decode-0.log").read_text().count("starting decode-0:") == 2
    assert {p.status for p in read_state(run / "state.json").processes} == {"stopped"}
    assert "is not running: this is the last state it wrote" in tidekv_status(env)
