"""Tidekv on a real local Ray cluster (``ray start --head`` on 127.0.0.1, token auth, stopped at the end).

One lifecycle, step by step: 2 Conductor replicas (sharing their state in a real
redis-server) + 2 prefill + 1 decode actors and the HTTP front come up and serve token-exact
(gRPC through each replica and the pair, and HTTP; the front holds no cluster secret and
serves its /metrics); `tidekv status` (another driver) reads every actor, load and address
from Ray; a prefill actor killed with ``ray.kill(no_restart=False)`` is restarted by Ray,
registers again and serves, while the cluster keeps serving on the others; while a killed
Conductor replica is down the other serves, and Ray brings it back on its port, caught up
with every worker; the decode pool is
scaled to 2 by the ``tidekv scale`` command (a second Ray driver) and back to 1 by the API; the
cluster stops; then the Ray cluster stops with no Ray or Tidekv process left behind. No copy
of the cluster secret stays on disk while the actors serve, and nothing an actor made in the
temp dir (a secret's file, a temporary SSD tier) outlives it, whether stopped, killed by
``ray.kill`` or ended by its instance's lost rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Ray reads these when it is imported: they must be set first. They keep every Ray address on
# loopback (no "localhost" resolved to this machine's network address), set token auth
# explicitly with a token made for this run, and let the actors import this checkout.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    "TIDEKV_TORCH_THREADS": "1",
}
_SAVED_ENV = {k: os.environ.get(k) for k in RAY_ENV}
os.environ.update(RAY_ENV)
ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.0' (the test extras)")

import engine  # noqa: E402
from conductor.client import Client  # noqa: E402
from conductor.config import ConductorConfig  # noqa: E402
from decode_worker.config import DecodeConfig  # noqa: E402
from deploy.local import free_port  # noqa: E402
from deploy.ray_launcher import RayCluster, RayClusterConfig, connect  # noqa: E402
from openai_api.config import FrontConfig  # noqa: E402
from prefill_worker.config import PrefillConfig  # noqa: E402
from tests.e2e.helpers import prompt, run_all  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the lifecycle takes about a minute; a hang must not take ten
NAMESPACE = "tidekv-test"
BLOCK = 16
HEAD_RESOURCES = {"tidekv_conductor": 2, "tidekv_prefill": 4, "tidekv_decode": 4}


def _ours(temp_dir: str) -> list[str]:
    """Command lines of live processes of this Ray cluster (its session dir is under temp_dir)
    or of Tidekv actors."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd or "RoleActor" in cmd:
            out.append(f"{proc.name}: {cmd[:160]}")
    return out


def _temp_dirs(*worker_ids: str) -> set[Path]:
    """Directories in the temp dir (the actors': ``ray start`` hands them this process's
    environment) holding a cluster secret (``deploy.ray_actors``) or a temporary SSD tier of one
    of ``worker_ids``. Compared before and after a test: others may have some of their own."""
    tmp = Path(tempfile.gettempdir())
    return {p for name in ("secret", *worker_ids) for p in tmp.glob(f"tidekv-{name}-*")}


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=2):
        return True
    return False


@pytest.fixture(scope="module")
def ray_head():
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temp_dir = tempfile.mkdtemp(prefix="tkray-", dir="/tmp")  # short: Ray's socket paths must fit
    address = f"127.0.0.1:{free_port()}"
    try:
        subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port",
                        address.rsplit(":", 1)[1], "--num-cpus", "2", "--resources", json.dumps(HEAD_RESOURCES),
                        "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir],
                       check=True, capture_output=True, timeout=120, cwd=ROOT)
        connect(address, NAMESPACE)
        yield address
    finally:
        ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)
        gcs_answers = _listening(address)  # (``ray status`` on a stopped cluster retries for ~45 s)
        for k, v in _SAVED_ENV.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        left = _ours(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not gcs_answers, f"Ray's GCS still listens on {address} after ray stop"
    assert not left, "processes left running:\n" + "\n".join(left)


@pytest.fixture(scope="module")
def reference():
    return engine.load_model("tiny")


def check_exact(endpoint: str, reference, salt: int, n: int = 4):
    reqs, want = [], []
    for i in range(n):
        ids = prompt(20 + 23 * i, salt + i)
        params = dict(temperature=0.7, seed=salt + i) if i % 2 else {}
        reqs.append(Client.request(ids, max_tokens=6, **params))
        want.append(engine.generate(reference, ids, 6, **params))
    outs = run_all(endpoint, reqs, max_workers=4)
    for out, w in zip(outs, want, strict=True):
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == w
    return outs


def wait_until(predicate, timeout_s: float, what: str):
    until = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            value = None
        if value:
            return value
        assert time.monotonic() < until, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.25)


ALL_WORKERS = {"prefill-0-0", "prefill-0-1", "decode-0-0"}
CONDUCTORS = ("conductor", "conductor-1")


def check_http(url: str, reference, salt: int) -> None:
    """A completion through the HTTP front actor, token-exact; its /metrics counts it."""
    import httpx

    ids = prompt(30, salt)
    r = httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == engine.generate(reference, ids, 6)
    metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert 'tidekv:http_requests_total{route="/v1/completions",status="200"}' in metrics


def niceness_of(pid: int) -> set[int]:
    """The niceness of each thread of process ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):
            out.add(int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()[16]))
    return out


def check_started(cluster: RayCluster, reference) -> dict:
    reports = {r.name: r for r in cluster.reports()}
    assert set(reports) == {*CONDUCTORS, "http", *ALL_WORKERS}
    assert all(r.ready and r.node_ip == "127.0.0.1" and r.address.startswith("127.0.0.1:")
               for r in reports.values()), reports
    assert all(reports[n].transfer_address.startswith("tcp://127.0.0.1:") for n in ALL_WORKERS)
    assert len({r.pid for r in reports.values()}) == 6 and os.getpid() not in {r.pid for r in reports.values()}
    # Ray starts its workers at niceness 15; the actors serve at 0, every thread (this test runs as root)
    assert {name: niceness_of(r.pid) for name, r in reports.items()} == dict.fromkeys(reports, {0})
    assert cluster.endpoint == f"{reports['conductor'].address},{reports['conductor-1'].address}"
    assert cluster.http_url == f"http://{reports['http'].address}/v1"
    assert ray.get(ray.get_actor("http", namespace=NAMESPACE).secret.remote()) == ""  # the front holds none
    outs = check_exact(cluster.endpoint, reference, salt=300)
    assert {o.prefill_worker for o in outs} == {"prefill-0-0", "prefill-0-1"}
    for i, name in enumerate(CONDUCTORS):  # the workers registered once; each replica serves them
        check_exact(reports[name].address, reference, salt=310 + 10 * i, n=2)
    check_http(cluster.http_url, reference, salt=350)
    return reports


def check_status(ray_address: str, tmp_path: Path) -> None:
    """`tidekv status` reads the cluster from Ray (a second driver): every actor, each worker's
    load, every address (each /metrics answers); a run's ray.json leads `status` and `top` there."""
    from deploy.ray_status import RayRun, write_ray_run
    from observe.top import scrape
    from tests.e2e.test_up import address_table

    def tidekv(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    text = tidekv("status", "--ray", ray_address, "--namespace", NAMESPACE)
    rows = address_table(text)
    assert set(rows) == {("conductor", "-"), ("conductor", "conductor-1"), ("http", "-"),
                         *((n.split("-")[0], n) for n in ALL_WORKERS)}, text
    for (role, _), row in rows.items():
        if role == "http":
            assert "127.0.0.1:" in row["HTTP"] and any(n.startswith("tidekv:") for n, _, _ in scrape(row["METRICS"]))
            continue
        assert row["GRPC"].startswith("127.0.0.1:")
        assert any(name.startswith("tidekv:") for name, _, _ in scrape(row["METRICS"])), row
        assert row["TRANSFER"].startswith("tcp://127.0.0.1:") or role == "conductor"
    workers = text.split("\nWORKER", 1)[1].split("\nROLE", 1)[0]
    assert {line.split()[0] for line in workers.splitlines()[1:]} == ALL_WORKERS, text
    as_json = json.loads(tidekv("status", "--ray", ray_address, "--namespace", NAMESPACE, "--json"))
    assert {a["name"] for a in as_json["actors"]} == {*CONDUCTORS, "http", *ALL_WORKERS}
    assert {w["worker_id"] for w in as_json["workers"]} == ALL_WORKERS and as_json["kind"] == "ray"
    run_dir = tmp_path / "up-run"  # what `tidekv up --ray` leaves for status and top
    write_ray_run(run_dir, RayRun(ray_address, NAMESPACE, as_json["endpoint"], 2**22 + 1, time.time()))
    again = tidekv("status", "--data-dir", str(run_dir))
    assert address_table(again) == rows and "which has exited" in again
    top = tidekv("top", "--data-dir", str(run_dir), "--iterations", "1")
    assert f"tidekv top - {rows['conductor', '-']['METRICS']}" in top and "prefill 2  decode 1" in top


def check_prefill_actor_restarts(cluster: RayCluster, reference, before, tmp_path) -> None:
    """A prefill actor dies: the other one serves meanwhile; Ray restarts it; it registers and serves."""
    ray.kill(ray.get_actor("prefill-0-1", namespace=NAMESPACE), no_restart=False)
    check_exact(cluster.endpoint, reference, salt=400)
    back = wait_until(lambda: next((r for r in cluster.reports() if r.name == "prefill-0-1"
                                    and r.pid != before.pid and r.ready), None),
                      120, "prefill-0-1 restarted and registered")
    assert back.address != before.address  # a new process, a new port
    assert (tmp_path / "prefill-0-1" / "ssd").is_dir()  # the same SSD tier, kept across the restart
    assert "prefill-0-1" in cluster.registered()
    outs = check_exact(cluster.endpoint, reference, salt=500)
    assert {o.prefill_worker for o in outs} == {"prefill-0-0", "prefill-0-1"}


def check_conductor_actor_restarts(cluster: RayCluster, reference, before) -> None:
    """A Conductor replica dies: the other serves meanwhile (clients fail over); Ray restarts
    it on its port, and it catches up with every worker from the shared state."""
    ray.kill(ray.get_actor("conductor", namespace=NAMESPACE), no_restart=False)
    check_exact(cluster.endpoint, reference, salt=540, n=2)

    def conductor_back() -> bool:
        pids = {r.pid for r in cluster.reports() if r.name == "conductor"}
        return bool(pids) and before.pid not in pids and cluster.registered() == ALL_WORKERS

    wait_until(conductor_back, 120, "a new Conductor with every worker registered again")
    check_exact(cluster.endpoint, reference, salt=550)
    check_http(cluster.http_url, reference, salt=560)  # the front's channel found the new Conductor


def check_decode_scales(cluster: RayCluster, reference, ray_address: str) -> None:
    """Decode to 2 from another driver (`tidekv scale`), then back to 1 through the API."""
    scaled = subprocess.run([sys.executable, "-m", "deploy.cli", "scale", "--ray", ray_address, "--namespace",
                             NAMESPACE, "--decode", "2"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    assert "decode-1-0" in scaled.stdout
    assert {"decode-0-0", "decode-1-0"} <= cluster.registered()
    outs = check_exact(cluster.endpoint, reference, salt=600)
    assert {o.decode_worker for o in outs} == {"decode-0-0", "decode-1-0"}
    cluster.scale("decode", 1)
    assert cluster.registered() == ALL_WORKERS
    assert not any(info["name"] == f"{NAMESPACE}-decode-g1" and info["state"] != "REMOVED"
                   for info in ray.util.placement_group_table().values())
    check_exact(cluster.endpoint, reference, salt=700)


def test_ray_cluster_lifecycle(ray_head, reference, tmp_path, redis_server):
    in_tmp = _temp_dirs(*ALL_WORKERS)
    config = RayClusterConfig(
        conductor=ConductorConfig(port=free_port(), policy="round_robin", worker_ttl_s=2.0, insecure_no_auth=True,
                                  index=redis_server.url, index_namespace=f"ray-{secrets.token_hex(4)}"),
        # A given data dir (one SSD tier per worker under it): a killed actor leaves nothing in /tmp.
        prefill=PrefillConfig(block_size=BLOCK, num_pages=256, drain_timeout_s=10, data_dir=str(tmp_path)),
        decode=DecodeConfig(block_size=BLOCK, num_pages=512, drain_timeout_s=10),
        http=FrontConfig(port=free_port()), num_prefill=2, num_decode=1, num_conductors=2, namespace=NAMESPACE,
        ready_timeout_s=150,
    )
    cluster = RayCluster(config)
    try:
        cluster.start()
        reports = check_started(cluster, reference)
        serving = _temp_dirs() - in_tmp
        assert not serving, f"a cluster secret on disk while the actors serve: {serving}"
        check_status(ray_head, tmp_path)
        check_prefill_actor_restarts(cluster, reference, reports["prefill-0-1"], tmp_path)
        check_conductor_actor_restarts(cluster, reference, reports["conductor"])
        check_decode_scales(cluster, reference, ray_head)
    finally:
        cluster.stop(grace_s=10)
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    assert not named, named
    groups = [i["name"] for i in ray.util.placement_group_table().values()
              if i["name"].startswith(NAMESPACE) and i["state"] != "REMOVED"]
    assert not groups, groups
    left = _temp_dirs(*ALL_WORKERS) - in_tmp
    assert not left, f"left in the temp dir by the actors (the killed ones included): {left}"


def test_ray_parallel_instance_one_group_packed_restarts_whole(ray_head, reference):
    """A TP=2 prefill instance on Ray: one placement group of two bundles, PACKed, rank 0 and its
    rank actor in them; it registers once and serves token-exact. Its rank actor killed, the
    instance ends (both actors exit), Ray restarts both, they meet again and it serves again.
    Neither leaves anything in the temp dir: rank 0's temporary SSD tier goes with its instance."""
    in_tmp = _temp_dirs("prefill-0-0", "decode-0-0")
    config = RayClusterConfig(
        conductor=ConductorConfig(port=free_port(), policy="round_robin", worker_ttl_s=2.0, insecure_no_auth=True),
        prefill=PrefillConfig(block_size=BLOCK, num_pages=256, drain_timeout_s=10, tp=2),
        decode=DecodeConfig(block_size=BLOCK, num_pages=512, drain_timeout_s=10),
        num_prefill=1, num_decode=1, namespace=NAMESPACE, ready_timeout_s=150,
    )
    cluster = RayCluster(config)
    try:
        cluster.start()
        groups = [i for i in ray.util.placement_group_table().values()
                  if i["name"] == f"{NAMESPACE}-prefill-g0" and i["state"] != "REMOVED"]
        assert len(groups) == 1 and groups[0]["strategy"] == "PACK" and len(groups[0]["bundles"]) == 2
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
        assert {"prefill-0-0", "prefill-0-0-r1", "decode-0-0"} <= names
        assert cluster.registered() == {"prefill-0-0", "decode-0-0"}
        before = next(r for r in cluster.reports() if r.name == "prefill-0-0")
        check_exact(cluster.endpoint, reference, salt=800)
        ray.kill(ray.get_actor("prefill-0-0-r1", namespace=NAMESPACE), no_restart=False)
        try:
            wait_until(lambda: next((r for r in cluster.reports() if r.name == "prefill-0-0" and r.pid != before.pid
                                     and r.ready), None), 150, "the instance restarted as a whole")
        except AssertionError:
            from ray._private.state import actors  # the GCS's table: no dashboard runs here

            print("DIAG", before, cluster.reports(),
                  [(a["Name"], a["State"], a.get("NumRestarts"), a.get("DeathCause")) for a in actors().values()])
            raise
        wait_until(lambda: "prefill-0-0" in cluster.registered(), 60, "the instance registered again")
        check_exact(cluster.endpoint, reference, salt=900)
        serving = _temp_dirs() - in_tmp
        assert not serving, f"a cluster secret on disk while the actors serve: {serving}"
    finally:
        cluster.stop(grace_s=10)
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    assert not named, named
    left = _temp_dirs("prefill-0-0", "decode-0-0") - in_tmp
    assert not left, f"left in the temp dir by the instance's actors (the ended ones included): {left}"
