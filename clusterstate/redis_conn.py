"""Connections to the shared store: ``redis://``, ``rediss://`` (TLS) and
``redis+sentinel://`` (high availability through Redis Sentinel), with AUTH.

    redis://[USER@]HOST:PORT[/DB]
    rediss://[USER@]HOST:PORT[/DB]                      TLS, verified against ``tls_ca``
    redis+sentinel://[USER@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]

The password never appears in a URL, a flag or a log: it comes from a file
(``--index-password-file``, one line), and serves both the data nodes and the sentinels. A
sentinel URL follows the primary through a failover (redis-py's ``SentinelConnectionPool``
asks the sentinels again when a connection to the old primary fails).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

SCHEMES = ("redis", "rediss", "redis+sentinel")


@dataclass(frozen=True)
class StoreAddress:
    """A parsed store URL: ``nodes`` are the data node (one) or the sentinels."""

    scheme: str
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    service: str = ""
    username: str | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    def describe(self) -> str:
        """The URL without credentials (what logs may show)."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{self.scheme}://{hosts}/{self.service + '/' if self.service else ''}{self.db}"


def parse_store_url(url: str) -> StoreAddress:
    """``ValueError`` naming the URL's problem (never echoing a password)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"--index must be memory or one of {', '.join(s + '://' for s in SCHEMES)}, got "
                         f"{parts.scheme or url!r}")
    if parts.password:
        raise ValueError("--index: put the password in --index-password-file, not in the URL (argv is readable)")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    username = unquote(parts.username) if parts.username else None
    nodes = []
    for item in netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--index: {item!r} is not HOST:PORT")
        nodes.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    service = ""
    if parts.scheme == "redis+sentinel":
        if not path:
            raise ValueError("--index: a redis+sentinel:// URL names the primary's service: "
                             "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB]")
        service, path = path[0], path[1:]
    elif len(nodes) != 1:
        raise ValueError(f"--index: {parts.scheme}:// takes one HOST:PORT (several are sentinels: redis+sentinel://)")
    if len(path) > 1 or (path and not path[0].isdigit()):
        raise ValueError(f"--index: the database must be a number, got {'/'.join(path)!r}")
    return StoreAddress(parts.scheme, tuple(nodes), int(path[0]) if path else 0, service, username)


def read_password(path: str) -> str | None:
    """The password in ``path`` (its first line); None when no file is given."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"--index-password-file {path}: {e.strerror or e}") from e
    if not text:
        raise ValueError(f"--index-password-file {path} is empty")
    return text.splitlines()[0]


def connect(address: StoreAddress, password: str | None = None, tls_ca: str = "",
            socket_timeout_s: float = 0.5) -> redis.Redis:
    """A client of the store's primary (no command is sent yet)."""
    # No retries inside redis-py: the log notices an unreachable store at once and serves from
    # its own state (clusterstate.redis_log), rather than holding a heartbeat for seconds.
    common = dict(username=address.username, password=password, socket_timeout=socket_timeout_s,
                  socket_connect_timeout=socket_timeout_s, health_check_interval=0, retry=Retry(NoBackoff(), 0))
    if address.scheme == "redis+sentinel":
        sentinel = Sentinel(list(address.nodes), sentinel_kwargs={k: common[k] for k in ("username", "password")}
                            | {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s},
                            **common)
        return sentinel.master_for(address.service, db=address.db, **common)
    host, port = address.nodes[0]
    # rediss:// is verified, against tls_ca when given, else the system's CAs.
    tls = dict(ssl=True, ssl_ca_certs=tls_ca or None, ssl_cert_reqs="required") if address.tls else {}
    return redis.Redis(host=host, port=port, db=address.db, **common, **tls)
