"""A worker instance as a group of ranks: starting them, the model each one runs, and ending
the whole instance the moment any rank is lost.

Owns the process side of ``engine.parallel``:

- ``instance_model`` (rank 0, inside the worker's service): for a shape of one rank, the
  plain model. Otherwise it starts the other ranks as processes of its own on this host
  (``WorkerConfig.dist_init`` empty: a private rendezvous directory) or waits for the ranks a
  launcher started (``tcp://HOST:PORT``, where rank 0 hosts the rendezvous), joins the group,
  and watches every rank (``runtime.rank_watch``): the model it returns is the group's face
  (``engine.parallel.leader.GroupModel``).
- ``serve_rank`` (the process of a rank other than 0, ``tidekv serve --role R --rank N``, or
  started by rank 0 as ``python -m runtime.ranks``): joins, follows rank 0's schedule, exits 0
  when rank 0 stops it.
- ``fail_fast``: what any rank does when another is lost (its watch connection closed, or a
  collective failed): deregister the instance at the Conductor (it leaves the registry at once:
  its requests are retried or migrated, nothing waits for a lease to run out), remove what the
  process made on disk for the instance (``remove_when_failing``: the exit skips every
  closer), then exit with ``EXIT_RANK_LOST``. The supervisor (or Kubernetes, or Ray) starts the
  instance again as a whole: rank 0 starts fresh ranks; a rank whose rank 0 died exits with it,
  removing the private rendezvous rank 0 can no longer remove.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from runtime.auth import Member, WorkerCredential, derive, worker_principal
from runtime.rank_watch import RankLink, RankWatch
from runtime.settings import argv_of, parse_config, setup_torch
from runtime.worker_config import WorkerConfig
from runtime.worker_link import deregister

log = logging.getLogger(__name__)
EXIT_RANK_LOST = 3
PROC_POLL_S = 0.2
_failing = threading.Lock()
_made_for_instance: list[str] = []  # what fail_fast removes (remove_when_failing)


def failing() -> bool:
    """True once this process is ending its instance (``fail_fast`` began)."""
    return _failing.locked()


def remove_when_failing(path: str) -> None:
    """Has ``fail_fast`` remove ``path`` before it ends this process: that exit runs no closer,
    and what the process keeps on disk for its instance (a temporary SSD tier, the ranks'
    private rendezvous) must not outlive it. ``path``: a directory this process made (removed
    with all it holds), or a file in one another process made (removed, then that directory
    once it is empty). The owner still removes it on a clean stop. Thread-safe."""
    _made_for_instance.append(path)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
        os.rmdir(os.path.dirname(path))  # fails, and the directory stays, while it holds anything else


def fail_fast(reason: str, deregister_instance: Callable[[str], object] | None) -> None:
    """Deregisters the instance (at most ~3 s) while it removes what was given to
    ``remove_when_failing``, and ends this process with ``EXIT_RANK_LOST``; never returns.
    Concurrent callers: the first one does it, the others wait for the exit."""
    if not _failing.acquire(blocking=False):
        time.sleep(3600)
    log.critical("ending this instance: %s", reason)
    deregistering = None
    if deregister_instance is not None:
        deregistering = threading.Thread(target=deregister_instance, args=(reason,), daemon=True)
        deregistering.start()
    for path in _made_for_instance:
        _remove(path)
    if deregistering is not None:
        deregistering.join(3.0)
    exit_now(EXIT_RANK_LOST)


def exit_now(code: int = 0) -> None:
    """Ends this process with ``code`` once its logs are flushed, skipping the interpreter's
    finalization: gloo's threads may still be inside the group being torn down, and abort it
    (exit -6) when the interpreter unloads under them. Never returns."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_key(member: Member) -> bytes:
    return derive(member.secret, "rank-watch")


def _leader_host(config: WorkerConfig) -> str:
    """Where the other ranks reach rank 0's watch: the rendezvous host, or loopback for ranks
    rank 0 started on its own host (everything between them then stays on loopback)."""
    if config.dist_init.startswith("tcp://"):
        return urlsplit(config.dist_init).hostname or "127.0.0.1"
    return "127.0.0.1"


class _LocalRanks:
    """The other ranks as child processes of rank 0 (``dist_init`` empty), with their
    rendezvous in a private directory; a child that exits on its own is a lost rank."""

    def __init__(self, config: WorkerConfig, role: str, worker_id: str, on_lost: Callable[[str], None]):
        self.dir = tempfile.mkdtemp(prefix="tidekv-ranks-")  # mode 0700: only this user meets here
        remove_when_failing(self.dir)
        self.init_method = f"file://{self.dir}/rendezvous"
        # The ranks' own connections (gloo's pairs, NCCL's bootstrap) on loopback, in every rank.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, config.parallel_shape.world_size):
            rank_config = dataclasses.replace(config, rank=rank, dist_init=self.init_method, worker_id=worker_id,
                                              warmup=False)
            args = argv_of(rank_config)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "runtime.ranks", "--role", role, *args],
                                               cwd=os.getcwd(), env={**os.environ, "TIDEKV_RANK_PARENT": "1"}))
        threading.Thread(target=self._watch, args=(on_lost,), name="rank-procs", daemon=True).start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        while not self._stopping:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self._stopping:
                    on_lost(f"rank {rank} (pid {p.pid}) exited with {p.returncode}")
                    return
            time.sleep(PROC_POLL_S)

    def expect_exits(self) -> None:
        """The ranks are being stopped: their exits are no loss."""
        self._stopping = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Waits for the ranks to exit (killing what is left after ``timeout_s``)."""
        self._stopping = True
        until = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def instance_model(config: WorkerConfig, role: str, credential: WorkerCredential,
                   deregister_instance: Callable[[str], object]) -> tuple[Any, Callable[[], None]]:
    """Rank 0's model and the callable that stops the other ranks (see the module docstring).
    ``deregister_instance(reason)``: takes this instance out of the registry (the worker's
    link; a no-op before it registered)."""
    import engine

    shape = config.parallel_shape
    if shape.is_single:
        return engine.load_model(config.model, device=config.device), lambda: None
    from engine.parallel.group import GroupFailed, leave_group
    from engine.parallel.instance import RankSpec, join

    def lost(reason: str) -> None:
        fail_fast(reason, deregister_instance)

    local = None if config.dist_init else _LocalRanks(config, role, credential.worker_id, lost)
    init_method = config.dist_init or local.init_method
    spec = RankSpec(config.model, shape, 0, init_method, config.device, timeout_s=config.dist_timeout_s)
    try:
        model = join(spec, on_failure=lost)
        watch_host = config.host if config.dist_init else "127.0.0.1"
        watch = RankWatch(watch_host, _watch_key(credential.member), credential.instance_id, shape.world_size - 1,
                          lost)
        model.channel.ints([watch.port], 1)  # the ranks' first message after joining: where to watch rank 0
        watch.wait_joined(config.dist_timeout_s)
    except (GroupFailed, RuntimeError, ValueError):
        if local is not None:
            local.stop(timeout_s=0.1)
        raise
    log.info("instance of %d ranks ready (%s)", shape.world_size, shape.describe())

    def close() -> None:
        watch.stopping()
        if local is not None:
            local.expect_exits()
        model.close()  # every rank leaves its loop, closes its watch connection and exits 0
        watch.close(wait_s=10.0)
        if local is not None:
            local.stop()
        leave_group()

    return model, close


def serve_rank(config: WorkerConfig, member: Member | None = None) -> None:
    """The life of a rank other than 0 (see the module docstring); returns when rank 0 stops it.
    ``member``: this rank's credential when its process holds the cluster secret already (a Ray
    rank actor, given it in memory); else it is read from ``config.cluster_secret_file``."""
    from engine.parallel.group import GroupFailed, leave_group
    from engine.parallel.instance import RankSpec, join

    setup_torch(config.threads or None)
    if not config.dist_init:
        raise SystemExit(f"rank {config.rank}: --dist-init is required (rank 0 starts its own ranks without it)")
    if member is None:
        member = Member.from_config(config.cluster_secret_file, worker_principal(config.worker_id), config.tls)
    addresses = [a.strip() for a in config.conductor.split(",") if a.strip()]
    instance = {"id": ""}

    def deregister_instance(reason: str) -> None:
        if instance["id"]:
            deregister(addresses, WorkerCredential(member, config.worker_id, instance["id"]), reason)

    if os.environ.get("TIDEKV_RANK_PARENT") == "1":  # a child of rank 0: it dies with it, even mid-start
        # and removes the private rendezvous that a rank 0 killed outright leaves behind
        remove_when_failing(urlsplit(config.dist_init).path)
        threading.Thread(target=_exit_with_parent, args=(os.getppid(), deregister_instance), name="rank-parent",
                         daemon=True).start()

    spec = RankSpec(config.model, config.parallel_shape, config.rank, config.dist_init, config.device,
                    timeout_s=config.dist_timeout_s)
    try:
        follower = join(spec)
        port = follower.channel.ints(None, 1)[0]
        link = RankLink(_leader_host(config), port, _watch_key(member), config.rank,
                        lambda reason: fail_fast(reason, deregister_instance))
        instance["id"] = link.instance_id
        log.info("rank %d of %s following rank 0", config.rank, config.worker_id)
        follower.run()
    except GroupFailed as e:
        fail_fast(str(e), deregister_instance)
    except Exception as e:  # outermost boundary of a rank: any failure ends the instance
        log.exception("rank %d failed", config.rank)
        fail_fast(f"rank {config.rank} failed: {e}", deregister_instance)
    link.close()
    leave_group()


def _exit_with_parent(parent: int, deregister_instance: Callable[[str], object]) -> None:
    """Ends this rank once its parent (rank 0) is gone, deregistering the instance first (the
    watch connection's close may be noticed later, or not before this exit)."""
    while os.getppid() == parent:
        time.sleep(PROC_POLL_S)
    fail_fast("rank 0 of the instance is gone (its process ended)", deregister_instance)


def main(argv: list[str] | None = None) -> None:
    """``python -m runtime.ranks --role prefill|decode FLAGS``: a rank other than 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--role" or argv[1] not in ("prefill", "decode"):
        raise SystemExit("usage: python -m runtime.ranks --role prefill|decode [worker flags] --rank N --dist-init URL")
    if argv[1] == "prefill":
        from prefill_worker.config import PrefillConfig as Config
    else:
        from decode_worker.config import DecodeConfig as Config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_rank(parse_config(Config, argv[2:], prog=f"tidekv rank ({argv[1]})"))
    exit_now(0)


if __name__ == "__main__":
    main()
