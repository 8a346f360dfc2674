"""TCP backend: frames with inline bodies over one asyncio (uvloop) stream per sender.

Bodies leave straight from the tensor's memory (``writelines`` of a memoryview) and land, via
``recv_into``, straight in the destination pages when the sink names them (``base.ViewSink``),
checksummed piece by piece as they land (``connection.FrameConnection.receive_into``); otherwise in
the connection's staging buffer, from which the sink copies them. Listeners bind ``config.bind_host`` (127.0.0.1 by
default). Every stream connection, of this backend and of shm and ucx (``serve_factory``,
``open_tcp``), starts with the authentication exchange of ``auth``. Runs on the I/O loop only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from kvstore.transfer.auth import accept_peer, connection_factory, prove_to
from kvstore.transfer.base import Address, RecvLink, TransferConfig, TransferError
from kvstore.transfer.frames import FrameError
from kvstore.transfer.wire import FrameConnection, StreamRecvLink, StreamSendLink

logger = logging.getLogger(__name__)
SOCKET_BUFFER_BYTES = 4 << 20


def tune_socket(transport: asyncio.BaseTransport) -> None:
    """Large kernel buffers so 16 MiB frames move in few wakeups."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


class StreamListener:
    """A listening server whose connections each become a receive link served by ``on_link``."""

    def __init__(self, address: str, server: asyncio.AbstractServer, tasks: set[asyncio.Task]):
        self.address = address
        self._server = server
        self._tasks = tasks

    def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()


def serve_factory(
    config: TransferConfig,
    scheme: str,
    make_link: Callable[[FrameConnection], Awaitable[RecvLink]],
    on_link: Callable[[RecvLink], Awaitable[None]],
    tasks: set[asyncio.Task],
    defer_data_bodies: bool = False,
):
    """Protocol factory for a listener: each accepted connection authenticates its peer
    (``auth.accept_peer``; a peer that fails is dropped there), then runs
    ``on_link(make_link(conn))``. ``defer_data_bodies``: inline data bodies wait for the
    receiver to say where they go (``connection.FrameConnection.receive_into``)."""

    async def accept(conn: FrameConnection) -> None:
        if not await accept_peer(conn, config, scheme):
            return
        try:
            link = await make_link(conn)
        except (TransferError, FrameError, OSError, TimeoutError) as exc:
            logger.warning("rejecting transfer connection: %s", exc)
            conn.close()
            return
        await on_link(link)

    def on_connected(conn: FrameConnection) -> None:
        task = asyncio.get_running_loop().create_task(accept(conn))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return connection_factory(config, on_connected, defer_data_bodies)


async def _plain_link(conn: FrameConnection) -> RecvLink:
    tune_socket(conn.transport)
    return StreamRecvLink(conn)


class TcpBackend:
    scheme = "tcp"

    async def listen(self, config: TransferConfig, on_link: Callable[[RecvLink], Awaitable[None]]) -> StreamListener:
        tasks: set[asyncio.Task] = set()
        factory = serve_factory(config, self.scheme, _plain_link, on_link, tasks, defer_data_bodies=True)
        server = await asyncio.get_running_loop().create_server(factory, config.bind_host, 0)
        host, port = server.sockets[0].getsockname()[:2]
        return StreamListener(str(Address("tcp", host=config.advertise_host or host, port=port)), server, tasks)

    async def connect(self, address: Address, config: TransferConfig) -> StreamSendLink:
        conn = await open_tcp(address, config)
        return StreamSendLink(conn)


async def open_tcp(address: Address, config: TransferConfig) -> FrameConnection:
    """Connect a FrameConnection to ``address.host:port`` and authenticate both ends
    (``auth.prove_to``), each within ``config.connect_timeout_s``; TransferError otherwise."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            transport, conn = await loop.create_connection(connection_factory(config), address.host, address.port)
    except (OSError, TimeoutError) as exc:
        raise TransferError(f"cannot connect to {address}: {exc!r}") from exc
    tune_socket(transport)
    try:
        await prove_to(conn, config, str(address))
    except BaseException:
        conn.close()
        raise
    return conn
