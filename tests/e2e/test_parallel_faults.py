"""A rank of a parallel instance SIGKILLed under load, real processes (``tidekv up --prefill 2
--decode 2 --tp 2``, supervised): mid-prefill (the other rank's collective fails at once; the
instance deregisters, the prefill is retried on the other instance), mid-decode (the stream
moves to the other decode instance), and rank 0 itself mid-decode (its ranks see it go and
deregister for it). Every request finishes token-exact against ``engine.generate``; the
instance leaves the registry by deregistering (the Conductor's log says so: no lease had to run
out), is started again as a whole by the supervisor and serves again. The tests assert where
requests went and what the logs and registry say, never how long anything took. Nothing of the
lost instance stays on disk: its ranks' private rendezvous directory is gone once its ranks
have exited (removed by whichever rank ended the instance, even when rank 0 was SIGKILLed)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from proto import inference_pb2 as pb
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all
from tests.e2e.test_parallel import rank_pids

pytestmark = pytest.mark.timeout(300)
LONG_PROMPT = 6000  # a prefill long enough to be caught running (and killed) from a poll of the registry
KILL_AFTER_TOKENS = 3


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(num_prefill=2, num_decode=2, policy="round_robin", supervise=True,
                           prefill_args=(*WORKER_ARGS, "--tp", "2"), decode_args=(*DECODE_ARGS, "--tp", "2"))
    with LocalCluster(config) as c:
        yield c


def _tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _instance(cluster, name: str) -> str:
    return next(w.rpc_address for w in cluster.workers().workers if w.worker_id == name)


def _wait_back(cluster, name: str, old_pid: int, timeout_s: float = 120.0) -> None:
    """Until the supervisor has started ``name`` again (a new rank 0 with its own rank 1) and
    it is registered."""
    until = time.monotonic() + timeout_s
    while True:
        proc = cluster.procs[name]
        registered = name in {w.worker_id for w in cluster.workers().workers}
        if proc.pid != old_pid and proc.poll() is None and registered and len(rank_pids(proc.pid)) == 1:
            return
        assert time.monotonic() < until, f"{name} did not come back"
        time.sleep(0.2)


def _deregistrations(cluster, name: str) -> int:
    """How often the Conductor's log says ``name`` deregistered (left at once, not by its lease)."""
    return (cluster.log_dir / "conductor.log").read_text().count(f"worker {name} deregistered")


def _exit_of(cluster, name: str, pid: int, timeout_s: float = 60.0) -> str:
    """How the supervisor saw process ``pid`` of ``name`` end."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        for e in cluster.events:
            if e.name == name and e.pid == pid and e.kind == "crashed":
                return e.exit
        time.sleep(0.1)
    raise AssertionError(f"no crash of {name} pid {pid} seen")


def _rendezvous_dir(rank_pid: int) -> Path:
    """The private directory of the rendezvous rank 0 gave this rank (``--dist-init file://DIR/rendezvous``)."""
    argv = Path(f"/proc/{rank_pid}/cmdline").read_bytes().decode().split("\0")
    init = argv[argv.index("--dist-init") + 1]
    assert init.startswith("file://"), init
    return Path(urlsplit(init).path).parent


def _running_prefill(cluster, timeout_s: float = 60.0) -> str:
    """The prefill worker whose heartbeat shows a running prefill."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        resp = cluster.workers()
        for info, load in zip(resp.workers, resp.loads, strict=True):
            if any(j.elapsed_s > 0 for j in load.prefill_jobs):
                return info.worker_id
        time.sleep(0.02)
    raise AssertionError("no prefill was seen running")


def test_rank_killed_mid_prefill(cluster, reference):
    ids = prompt(LONG_PROMPT, 41)
    result = {}
    t = threading.Thread(target=lambda: result.update(out=run_all(cluster.endpoint,
                                                                  [Client.request(ids, max_tokens=8)])[0]))
    t.start()
    victim = _running_prefill(cluster)
    old_pid = cluster.procs[victim].pid
    before = _deregistrations(cluster, victim)
    (rank1,) = rank_pids(old_pid)
    rendezvous = _rendezvous_dir(rank1)
    assert rendezvous.is_dir()
    os.kill(rank1, signal.SIGKILL)
    t.join(240)
    out = result["out"]
    assert out.finish_reason == "length", out.error
    assert out.token_ids == engine.generate(reference, ids, 8)
    assert out.prefill_worker != victim  # retried on the other instance: the kill was mid-prefill
    assert _exit_of(cluster, victim, old_pid) == "exited with 3"  # runtime.ranks.EXIT_RANK_LOST
    assert not rendezvous.exists()  # rank 0 removed it before it exited
    assert _deregistrations(cluster, victim) == before + 1
    _wait_back(cluster, victim, old_pid)
    again = prompt(300, 42)
    outs = run_all(cluster.endpoint, [Client.request(again, max_tokens=8) for _ in range(2)])
    assert {o.prefill_worker for o in outs} == {"prefill-0", "prefill-1"}
    assert all(o.token_ids == engine.generate(reference, again, 8) for o in outs)


def _stream_and_kill(cluster, req: pb.GenerateRequest, kill) -> tuple[list[pb.GenerateResponse], str]:
    client = Client(cluster.endpoint)
    msgs: list[pb.GenerateResponse] = []
    victim = ""
    try:
        for msg in client.stub.Generate(req, timeout=300):
            msgs.append(msg)
            if not victim and len(_tokens(msgs)) >= KILL_AFTER_TOKENS:
                victim = msgs[0].decode_worker
                kill(victim)
    finally:
        client.close()
    assert victim, "the request ended before it was mid-stream"
    return msgs, victim


@pytest.mark.parametrize("which", ["rank 1", "rank 0"])
def test_rank_killed_mid_decode(cluster, reference, which):
    ids = prompt(60, 43 if which == "rank 1" else 44)
    expected = engine.generate(reference, ids, 500)
    killed: dict[str, int] = {}
    rendezvous: list[Path] = []

    def kill(name: str) -> None:
        rank0 = cluster.procs[name].pid
        (rank1,) = rank_pids(rank0)
        killed.update(rank0=rank0, rank1=rank1, before=_deregistrations(cluster, name))
        rendezvous.append(_rendezvous_dir(rank1))
        if which == "rank 1":
            os.kill(rank1, signal.SIGKILL)
        else:
            cluster.kill(name, restart=True)  # SIGKILL, counted as a crash: the supervisor restarts it

    msgs, victim = _stream_and_kill(cluster, Client.request(ids, max_tokens=500), kill)
    assert [m.finish_reason for m in msgs if m.finish_reason] == [pb.FINISH_REASON_LENGTH]
    assert _tokens(msgs) == expected
    moved = [m.decode_worker for m in msgs[1:] if m.decode_worker]
    assert len(moved) == 1 and moved[0] != victim
    exit_ = _exit_of(cluster, victim, killed["rank0"])
    assert exit_ == ("exited with 3" if which == "rank 1" else "killed by SIGKILL")
    _wait_back(cluster, victim, killed["rank0"])
    # Rank 1 deregistered for its lost rank 0 (or rank 0 for its lost rank 1); then it is gone.
    assert _deregistrations(cluster, victim) == killed["before"] + 1
    until = time.monotonic() + 30
    while _alive(killed["rank1"]):
        assert time.monotonic() < until, "the old rank 1 outlived its instance"
        time.sleep(0.1)
    assert not rendezvous[0].exists()  # removed by the rank that ended the instance, before it exited
    outs = run_all(cluster.endpoint, [Client.request(ids, max_tokens=20) for _ in range(2)])
    assert {o.decode_worker for o in outs} == {"decode-0", "decode-1"}
    assert all(o.token_ids == expected[:20] for o in outs)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
