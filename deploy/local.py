"""Local process clusters: Conductors plus prefill and decode workers on 127.0.0.1, supervised.

One Conductor by default (its cluster state in memory); with ``num_conductors`` N > 1 the
Conductors are replicas over one shared state in a store: ``index`` if it names one, else a
``redis-server`` this cluster starts and supervises itself (AUTH with a password made in the
data dir, append-only file there, so a restarted store keeps the log). Workers and the HTTP
front are given every Conductor's address and use whichever answers.

``LocalCluster`` starts each role as its own ``tidekv serve`` process, waits until every
worker has registered with the Conductor, then watches every process from a supervisor
thread (``deploy/supervision.py``): an exit nobody asked for is reported (logged, kept in
``events``, passed to ``on_event``) and, with ``ClusterConfig.supervise``, the process is
started again with the same flags after a backoff; a worker re-registers under the same id
by itself, a prefill worker finds its SSD tier in the same data dir, the Conductor and the
HTTP front come back on the same ports. ``stop`` sends SIGTERM (drain) front to back and
then SIGKILL to whatever is left. Each process logs to ``<log_dir>/<name>.log`` (default
``<data_dir>/logs``; files 0600 in a 0700 directory), appended to with a separator line at
every start and never deleted; the state (``deploy/cluster_state.py``: processes, and the workers' loads from the
Conductor's registry, polled every ``WORKERS_POLL_S``) is rewritten to ``state_file``
(default ``<data_dir>/state.json``) on every change.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deploy.cluster_state import ClusterState, Endpoint, WorkerState, endpoints, workers_from_response, write_state
from deploy.local_store import LocalStore
from deploy.supervision import ProcessEvent, RestartPolicy, Supervisor
from proto import internal_pb2 as ipb
from proto import internal_pb2_grpc as igrpc
from runtime.auth import CONDUCTOR, OPERATOR, Member
from runtime.certs import make_certs
from runtime.logs import private_log
from runtime.ports import free_port
from runtime.private import private_dir
from runtime.tls import TlsFiles

log = logging.getLogger(__name__)

WORKERS_POLL_S = 2.0  # how often the state file's worker loads are refreshed from the registry


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    policy: str = "mooncake"
    index: str = "memory"
    calibration: str = ""  # cost-model file for the Conductor ("" = its built-in estimate)
    port: int = 0
    data_dir: str = ""
    threads_per_process: int = 1
    # All roles share this host's cores: prefill is throughput work, decode is latency-bound,
    # so prefill processes run at a lower CPU priority (os.nice) than decode and the Conductor.
    prefill_nice: int = 10
    conductor_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    # More flags for one process by name ("prefill-1": ("--tp", "2")), after its role's: instances
    # of different parallel shapes in one cluster.
    instance_args: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    env: dict[str, str] = field(default_factory=dict, hash=False)
    http_port: int = -1  # the OpenAI HTTP front: -1 none, 0 a free port
    num_conductors: int = 1  # > 1: replicas over one shared state (a store: index, or one started here)
    index_password_file: str = ""  # the store's password, for an index given here
    http_args: tuple[str, ...] = ()  # more flags of the front (its limits: docs/api-http.md)
    # Restart a process that dies while the cluster runs (`tidekv up` turns it on). Off by default
    # (exits are still reported): tests and benches kill workers to watch the cluster fail over.
    supervise: bool = False
    restart_policy: RestartPolicy = RestartPolicy()
    log_dir: str = ""  # "" = <data_dir>/logs
    state_file: str = ""  # "" = <data_dir>/state.json
    # The public endpoint's API keys file (conductor.apikeys); "" serves it without keys, under
    # the Conductor's loud --insecure-no-auth (a local cluster is a demo or a test).
    api_keys: str = ""
    tls: bool = False  # serve every gRPC port over TLS with certificates made in <data_dir>/tls


class LocalCluster:
    """``on_event(event)`` is called on the supervisor's thread for every ``ProcessEvent``."""

    def __init__(self, config: ClusterConfig = ClusterConfig(),
                 on_event: Callable[[ProcessEvent], None] | None = None):
        self.config = config
        # A directory made here is removed by stop() (with the logs and state inside it, unless
        # log_dir and state_file put them elsewhere); a given one (logs, SSD tiers) is kept.
        self._owns_data_dir = not config.data_dir
        self.data_dir = Path(config.data_dir or tempfile.mkdtemp(prefix="tidekv-up-"))
        if config.num_conductors < 1:
            raise ValueError(f"num_conductors must be >= 1, got {config.num_conductors}")
        self.ports = [config.port or free_port(), *(free_port() for _ in range(config.num_conductors - 1))]
        self.port = self.ports[0]
        self.metrics_ports = [free_port() for _ in self.ports]  # the Conductors' /metrics; workers pick their own
        self.metrics_port = self.metrics_ports[0]
        self.store: LocalStore | None = None
        self.http_port = (config.http_port or free_port()) if config.http_port >= 0 else -1
        self.log_dir = Path(config.log_dir) if config.log_dir else self.data_dir / "logs"
        self.state_file = Path(config.state_file) if config.state_file else self.data_dir / "state.json"
        self._state_lock = threading.Lock()  # one writer of the state file at a time
        self._workers: tuple[WorkerState, ...] = ()
        self._workers_error = "the cluster is starting"
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self._supervisor = Supervisor(config.supervise, config.restart_policy, on_event, self._write_state)
        # The cluster secret every member proves it knows (runtime.auth); made once per data dir.
        self.secret_file = self.data_dir / "cluster.secret"
        if not self.secret_file.exists():
            private_dir(self.data_dir)
            fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self.index, self.index_password_file = config.index, config.index_password_file
        if config.num_conductors > 1 and config.index in ("", "memory"):
            self.store = LocalStore(self.data_dir / "store")
            self.index, self.index_password_file = self.store.url, str(self.store.password_file)
        self.tls = TlsFiles()
        if config.tls:
            certs = self.data_dir / "tls"
            if not (certs / "server.pem").exists():
                make_certs(certs)
            self.tls = TlsFiles(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem"))

    def _tls_args(self, serves: bool = True) -> list[str]:
        if not self.tls.ca:
            return []
        return (["--tls-cert", self.tls.cert, "--tls-key", self.tls.key] if serves else []) + ["--tls-ca", self.tls.ca]

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """Each process by name: the current one (a new one after a restart). A copy."""
        return self._supervisor.procs()

    @property
    def events(self) -> list[ProcessEvent]:
        """Every exit and restart the supervisor saw, oldest first."""
        return self._supervisor.events

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL, restart: bool = False) -> None:
        """Sends ``sig`` to process ``name`` and returns. ``restart=False``: its exit is on
        purpose (reported as stopped, never restarted); True: it counts as a crash (restarted
        when the cluster supervises)."""
        if not restart:
            self._supervisor.expect_exit(name)
        self.procs[name].send_signal(sig)

    def state(self, refresh_workers: bool = False) -> ClusterState:
        """Every process's state and each registered worker's load (``refresh_workers``: asked
        of the Conductor now, else as last polled)."""
        if refresh_workers:
            self._refresh_workers()
        return ClusterState(self.endpoints, self.http_url, str(self.log_dir), os.getpid(), time.time(),
                            self._supervisor.states(), self._workers, self._workers_error,
                            ",".join(f"127.0.0.1:{p}" for p in self.metrics_ports))

    def _write_state(self) -> None:
        with self._state_lock:
            try:
                write_state(self.state_file, self.state())
            except OSError as e:  # the cluster runs on without its state file
                log.warning("cannot write the cluster state to %s: %s", self.state_file, e)

    def _refresh_workers(self) -> None:
        """Reads the registry; rewrites the state file if the workers or their loads changed."""
        try:
            workers, error = workers_from_response(self.workers()), ""
        except grpc.RpcError as e:
            workers, error = (), f"{e.code().name}: {e.details()}"
        if (workers, error) != (self._workers, self._workers_error):
            self._workers, self._workers_error = workers, error
            self._write_state()

    def _watch_workers(self) -> None:
        while not self._stop_watching.wait(WORKERS_POLL_S):
            self._refresh_workers()

    @property
    def http_url(self) -> str:
        """The OpenAI HTTP front's base URL ("" without one)."""
        scheme = "https" if self.tls.ca else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}/v1" if self.http_port > 0 else ""

    def metrics_addresses(self) -> list[str]:
        """Every process's /metrics host:port: the Conductors', each registered worker's, the HTTP front's."""
        return [*(f"127.0.0.1:{p}" for p in self.metrics_ports),
                *(w.metrics_address for w in self.workers().workers if w.metrics_address),
                *([f"127.0.0.1:{self.http_port}"] if self.http_port > 0 else [])]

    def addresses(self) -> tuple[Endpoint, ...]:
        """Every process's addresses (role, worker id, gRPC, transfer, metrics, HTTP), the
        workers' as the Conductors' registry lists them now."""
        return endpoints(self.endpoints, ",".join(f"127.0.0.1:{p}" for p in self.metrics_ports),
                         workers_from_response(self.workers()), self.http_url)

    def conductor_counter(self, name: str) -> float:
        """The Conductors' counter ``tidekv:NAME_total``, summed over its labels and the
        replicas (0 when absent)."""
        from observe.top import scrape

        return sum(value for port in self.metrics_ports
                   for metric, _, value in scrape(f"127.0.0.1:{port}", timeout_s=10)
                   if metric == f"tidekv:{name}_total")

    @property
    def endpoint(self) -> str:
        """The first Conductor's address (any replica serves the same cluster)."""
        return f"127.0.0.1:{self.port}"

    def block_keys(self, token_ids, block_size: int, model_fingerprint: str, tenant: str = "") -> list[bytes]:
        """The keys this cluster's Conductors give the blocks of ``token_ids`` (keyed with a key
        derived from its secret: kvstore.blocks)."""
        from kvstore.blocks import chain_keys
        from runtime.auth import derive, load_secret

        key = derive(load_secret(str(self.secret_file)), "block-keys")
        return chain_keys(token_ids, block_size, model_fingerprint, tenant, key)

    @property
    def conductor_addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def endpoints(self) -> str:
        """Every Conductor's address, comma-separated (what clients and workers are given)."""
        return ",".join(self.conductor_addresses)

    @staticmethod
    def conductor_name(i: int) -> str:
        return "conductor" if i == 0 else f"conductor-{i}"

    def _spawn(self, name: str, role: str, args: list[str], nice: int = 0, member: bool = True) -> None:
        """Starts process ``name`` and hands it to the supervisor, which starts it again the
        same way after a crash. Every start appends to its log, after a separator line. A
        ``member`` gets the cluster secret's file; the HTTP front, which signs nothing, does not."""
        log_path = self.log_dir / f"{name}.log"
        # MALLOC_ARENA_MAX: glibc gives each of a worker's ~35 threads its own arena, and the
        # prefill worker's RSS then keeps growing with freed but unreturned memory (bench/soak.py).
        env = {"MALLOC_ARENA_MAX": "2", **os.environ, "TIDEKV_TORCH_THREADS": str(self.config.threads_per_process),
               "TIDEKV_CLUSTER_SECRET_FILE": str(self.secret_file), **self.config.env}
        if not member:
            env.pop("TIDEKV_CLUSTER_SECRET_FILE")
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--role", role, *args]

        def launch() -> subprocess.Popen:
            with private_log(log_path) as f:  # 0600 in a 0700 directory
                f.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}: "
                        f"tidekv serve --role {role} {shlex.join(args)} =====\n")
                f.flush()
                return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                        cwd=Path(__file__).resolve().parent.parent,
                                        preexec_fn=(lambda: os.nice(nice)) if nice else None)

        self._supervisor.add(name, role, launch, log_path)

    def channel(self, address: str, audience: str = CONDUCTOR) -> grpc.Channel:
        """A channel to one of this cluster's processes, signed as an operator (a member) for
        ``audience``: ``CONDUCTOR``, or ``worker_principal(id)`` of the worker at ``address``."""
        return Member(self.secret_file.read_text().strip().encode(), OPERATOR, self.tls).channel(address,
                                                                                                 audience=audience)

    def _spawn_conductor(self, i: int) -> None:
        c = self.config
        extra = ["--calibration", c.calibration] if c.calibration else []
        extra += ["--api-keys", c.api_keys] if c.api_keys else ["--insecure-no-auth"]
        extra += ["--index-password-file", self.index_password_file] if self.index_password_file else []
        self._spawn(self.conductor_name(i), "conductor", [
            "--port", str(self.ports[i]), "--model", c.model, "--policy", c.policy, "--index", self.index,
            "--metrics-port", str(self.metrics_ports[i]), *extra, *self._tls_args(), *c.conductor_args])

    def restart_conductor(self, timeout_s: float = 60.0, i: int = 0, down_s: float = 0.0) -> None:
        """Kills Conductor ``i`` (SIGKILL: no drain, on purpose: not a crash) and starts a new
        one on the same port ``down_s`` later; with its state in memory, the workers re-register
        with it (and republish their blocks) on their next heartbeat; a replica catches up from
        the log."""
        self._supervisor.replace(self.conductor_name(i), down_s)
        self.wait_ready(timeout_s)

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        c = self.config
        if self.store is not None:
            self._supervisor.add("store", "store", self.store.launch, self.store.log_path)
            self.store.wait_ready(timeout_s)
        for i in range(len(self.ports)):
            self._spawn_conductor(i)
        for i in range(c.num_prefill):
            self._spawn(f"prefill-{i}", "prefill", [
                "--conductor", self.endpoints, "--worker-id", f"prefill-{i}", "--model", c.model,
                "--data-dir", str(self.data_dir / f"prefill-{i}"), *self._tls_args(), *c.prefill_args,
                *c.instance_args.get(f"prefill-{i}", ())], nice=c.prefill_nice)
        for i in range(c.num_decode):
            self._spawn(f"decode-{i}", "decode", ["--conductor", self.endpoints, "--worker-id", f"decode-{i}",
                                                 "--model", c.model, *self._tls_args(), *c.decode_args,
                                                 *c.instance_args.get(f"decode-{i}", ())])
        try:
            self.wait_ready(timeout_s)
            if self.http_port > 0:
                keys = ["--api-keys", c.api_keys] if c.api_keys else []
                self._spawn("http", "http", ["--conductor", self.endpoints, "--port", str(self.http_port),
                                             "--model", c.model, *keys, *self._tls_args(), *c.http_args],
                            member=False)
                self._wait_http(timeout_s)
        except BaseException:
            self.stop()
            raise
        self._supervisor.start()
        self._refresh_workers()
        self._watcher = threading.Thread(target=self._watch_workers, name="tidekv-workers", daemon=True)
        self._watcher.start()
        return self

    def _wait_http(self, timeout_s: float) -> None:
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=self.tls.ca) if self.tls.ca else None
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            if self.procs["http"].poll() is not None:
                tail = (self.log_dir / "http.log").read_text()[-2000:]
                raise RuntimeError(f"the HTTP front exited with {self.procs['http'].returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.http_url.removesuffix("/v1") + "/health", timeout=2, context=context):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the HTTP front did not answer within {timeout_s:.0f}s")

    def workers(self, conductor: str = "") -> ipb.WorkersResponse:
        """The alive workers as a Conductor sees them (default: the first that answers)."""
        addresses = [conductor] if conductor else self.conductor_addresses
        for i, address in enumerate(addresses):
            ch = self.channel(address)
            try:
                return igrpc.RegistryStub(ch).Workers(ipb.WorkersRequest(), timeout=5)
            except grpc.RpcError:
                if i == len(addresses) - 1:
                    raise
            finally:
                ch.close()
        raise AssertionError("unreachable")

    def wait_ready(self, timeout_s: float) -> None:
        """Until every Conductor sees every worker registered and alive; RuntimeError naming a
        process that died."""
        want = self.config.num_prefill + self.config.num_decode
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{name} exited with {p.returncode} during start-up:\n{tail}")
            try:
                if all(len(self.workers(a).workers) >= want for a in self.conductor_addresses):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not ready within {timeout_s:.0f}s (logs in {self.log_dir})")

    def stop(self, grace_s: float = 20.0) -> None:
        """Stops supervising (nothing is restarted from here on), then drains front to back:
        SIGTERM the HTTP front, then the Conductors, and wait (in-flight requests finish on live
        workers), then SIGTERM the workers, then the store; SIGKILL whatever outlives ``grace_s``. Writes the
        final state; removes a data dir it made (see ``__init__``), else keeps everything. Idempotent."""
        self._supervisor.stop()
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join()
        procs = self.procs
        until = time.monotonic() + grace_s
        conductors = [self.conductor_name(i) for i in range(len(self.ports))]
        fronts = [[n for n in procs if n == "http"], [n for n in procs if n in conductors]]
        workers = [n for n in procs if n not in ("http", "store", *conductors)]
        for group in (*fronts, workers, [n for n in procs if n == "store"]):
            for name in group:
                if procs[name].poll() is None:
                    procs[name].send_signal(signal.SIGTERM)
            for name in group:
                p = procs[name]
                try:
                    p.wait(timeout=max(0.1, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._workers, self._workers_error = (), "the cluster is stopped"
        self._supervisor.mark_stopped()
        if self._owns_data_dir:  # a test's or a bench's: nothing of it stays (`tidekv up` keeps
            shutil.rmtree(self.data_dir, ignore_errors=True)  # its logs in a log_dir outside it)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
