"""The Ray launcher's pieces that need no running Ray cluster: the in-memory secret file a
``RoleActor`` hands its service, the replicas' config, and how a restarted rank asks for its
instance's rendezvous. The cluster itself is tested in ``test_ray.py``."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.0' (the test extras)")

from conductor.config import ConductorConfig  # noqa: E402
from deploy import ray_actors  # noqa: E402
from deploy.ray_launcher import RayClusterConfig  # noqa: E402


def test_an_actors_secret_file_lives_in_memory_only_while_its_service_reads_it():
    """What a RoleActor hands its service: a path that reads as the secret, readable by another
    process of this user (a service may hand it on), never a file on disk, gone on leaving
    (and with the process, SIGKILL included: the kernel frees an unreferenced memfd)."""
    secret = secrets.token_hex(32)
    in_tmp = set(Path(tempfile.gettempdir()).iterdir())
    with ray_actors._secret_file(secret) as path:
        assert Path(path).read_text() == secret
        assert (os.stat(path).st_mode & 0o777) == 0o600
        other = subprocess.run([sys.executable, "-c", f"print(open({path!r}).read())"],
                               capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == secret, other.stderr
        assert set(Path(tempfile.gettempdir()).iterdir()) == in_tmp
    with pytest.raises(OSError):
        Path(path).read_text()


def test_conductor_replicas_on_ray_need_a_shared_store_and_ports_of_their_own():
    with pytest.raises(ValueError, match="--index redis://"):
        RayClusterConfig(num_conductors=2)
    config = RayClusterConfig(conductor=ConductorConfig(port=50051, metrics_port=9400, index="redis://r:6379/0"),
                              num_conductors=3)
    assert config.conductor_names == ("conductor", "conductor-1", "conductor-2")
    assert [(config.replica_config(r).port, config.replica_config(r).metrics_port) for r in range(3)] == [
        (50051, 9400), (50052, 9401), (50053, 9402)]


def test_a_restarted_rank_asks_its_restarting_rank_0_again_until_it_names_a_rendezvous(monkeypatch):
    """A rank restarted by Ray asks rank 0's actor while that one ends its instance ("") and
    while Ray restarts it (the call raises): it asks again, since an exception would fail its
    actor's creation for good (Ray never retries that). It gives up, naming the last answer,
    once the wait is over."""
    monkeypatch.setattr(ray_actors, "RENDEZVOUS_POLL_S", 0.0)
    answers = iter(["", ray.exceptions.ActorUnavailableError("restarting", None),
                    ValueError("Failed to look up actor with name 'prefill-0-0'"), "tcp://10.0.0.7:29500"])

    def ask() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert ray_actors.leader_rendezvous(ask, "prefill-0-0", 60.0) == "tcp://10.0.0.7:29500"

    def restarting() -> str:
        raise ray.exceptions.ActorUnavailableError("restarting", None)

    with pytest.raises(RuntimeError, match=r"prefill-0-0 named no rendezvous within 0 s; last: ActorUnavailable"):
        ray_actors.leader_rendezvous(restarting, "prefill-0-0", 0.0)
