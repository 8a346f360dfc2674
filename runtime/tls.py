"""TLS settings every serving process shares: ``TlsFiles`` (the PEM files and the gRPC
credentials made from them) and ``ServesConfig`` (what a role's config derives from its host
and TLS fields).

Plain frozen values: a config that holds them (the Conductor's, a worker's) imports no gRPC,
so the simulator reads those configs without it; grpc loads when credentials are made.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: ``cert``+``key`` make a server serve TLS; ``ca`` makes a client verify it.
    ``tidekv certs`` makes a local CA and a server certificate for the cluster's hosts."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")

    @property
    def serves(self) -> bool:
        return bool(self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials([(_read(self.key, "tls_key"), _read(self.cert, "tls_cert"))])

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "tls_ca")) if self.ca else None


class ServesConfig:
    """What every serving process's config derives from its ``host``, ``advertise_host`` and
    ``tls_cert``/``tls_key``/``tls_ca`` fields (a mixin of the frozen config dataclasses)."""

    host: str
    advertise_host: str
    tls_cert: str
    tls_key: str
    tls_ca: str

    @property
    def advertised_host(self) -> str:
        """The host other processes dial: --advertise-host, else --host (loopback for a wildcard)."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{field} {path}: {e.strerror or e}") from e
