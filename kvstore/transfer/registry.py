"""Backend lookup by address scheme. tcp and shm load eagerly; ucx (ucxx, optional extra) loads
on first use so processes that never use it never import it. Stateless apart from imports.
"""

from __future__ import annotations

import importlib.util

from kvstore.transfer.base import SCHEMES, Backend


def ucx_unavailable_reason() -> str | None:
    """None when the ucx backend can be used here, else why not (imports ucxx to find out)."""
    if importlib.util.find_spec("ucxx") is None:
        return "ucxx is not installed (pip install 'tidekv[ucx]', i.e. ucxx-cu12)"
    try:
        import kvstore.transfer.ucx  # noqa: F401 - sets UCX's environment defaults, then imports ucxx
    except (ImportError, OSError) as exc:
        return f"ucxx is installed but does not import: {exc!r}"
    return None


def get_backend(scheme: str) -> Backend:
    """The backend for an address scheme ("shm", "tcp", "ucx")."""
    if scheme == "tcp":
        from kvstore.transfer.tcp import TcpBackend

        return TcpBackend()
    if scheme == "shm":
        from kvstore.transfer.shm import ShmBackend

        return ShmBackend()
    if scheme == "ucx":
        reason = ucx_unavailable_reason()
        if reason is not None:
            raise ValueError(f"ucx backend unavailable: {reason}")
        from kvstore.transfer.ucx import UcxBackend

        return UcxBackend()
    raise ValueError(f"unknown transfer backend {scheme!r}; known: {SCHEMES}")
