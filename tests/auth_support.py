"""One cluster secret for the tests that start roles themselves (LocalCluster makes its own)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import grpc

from runtime.auth import CONDUCTOR, OPERATOR, Member, new_secret

_dir = tempfile.mkdtemp(prefix="tidekv-test-secret-")
atexit.register(shutil.rmtree, _dir, ignore_errors=True)
SECRET_FILE = str(Path(_dir) / "cluster.secret")
fd = os.open(SECRET_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
with os.fdopen(fd, "w") as f:
    f.write(new_secret())
SECRET_ENV = {"TIDEKV_CLUSTER_SECRET_FILE": SECRET_FILE}


def operator_channel(address: str, secret_file: str = SECRET_FILE, audience: str = CONDUCTOR) -> grpc.Channel:
    """A channel to a cluster process (the Conductor unless ``audience`` names a worker),
    signed as an operator with the cluster secret."""
    return Member(Path(secret_file).read_text().strip().encode(), OPERATOR).channel(address, audience=audience)
