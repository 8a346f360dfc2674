"""The in-process baselines and the two ceilings of ``bench.transfer`` (see its docstring):
plain memory copies, the one-copy shm transfer's own work without the transfer, a bare
loopback TCP stream between two processes (``sendall`` / ``recv_into``, no framing, no
checksum), the most any TCP transfer here can move, and bare UCX tag messages between two
processes (``ucx_ceiling_child``), the most the ucx backend's UCX can move.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import socket
import sys
import time

import numpy as np

from kvstore.transfer.tcp import SOCKET_BUFFER_BYTES  # the tcp backend's kernel buffers


def memcpy_gbps(size: int, total_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of ``total_bytes`` in ``size`` pieces between the same two ``size``
    buffers (the issue's baseline; both stay in cache, so at 16 MiB it is an upper bound)."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    count = total_bytes // size
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        samples.append(count * size / (time.perf_counter() - start) / 1e9)
    return samples


def streaming_memcpy_gbps(size: int, total_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of the bytes one transfer sample moves: ``total_bytes`` of distinct
    source into distinct destination, in ``size`` pieces, in one process."""
    src = np.ones(total_bytes, dtype=np.uint8)
    dst = np.ones(total_bytes, dtype=np.uint8)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for offset in range(0, total_bytes, size):
            np.copyto(dst[offset : offset + size], src[offset : offset + size])
        samples.append(total_bytes / (time.perf_counter() - start) / 1e9)
    return samples


def one_copy_gbps(size: int, total_bytes: int, repeats: int, verify: bool, algo=None) -> list[float]:
    """The work of one direct shm transfer of ``total_bytes`` in ``size`` frames, without the
    transfer: each frame ``copy_with_checksum``-ed from a distinct source into distinct
    shareable memory (the sender) and, with ``verify``, checksummed there (the receiver), all
    in this thread; ``algo``: the checksum (default: the transfer engine's)."""
    from kvstore.transfer.direct import checksum_of, copy_with_checksum
    from kvstore.transfer.frames import default_checksum_algo

    algo = algo or default_checksum_algo()
    src = np.ones(total_bytes, dtype=np.uint8)
    fd = os.memfd_create("tidekv-bench-one-copy", os.MFD_CLOEXEC)  # as engine.memory.shareable_zeros
    try:
        os.ftruncate(fd, total_bytes)
        mapping = mmap.mmap(fd, total_bytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    dst = np.frombuffer(mapping, dtype=np.uint8)
    dst[:] = 0  # the transfer's warmup request has touched every page of the pool too
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for offset in range(0, total_bytes, size):
            frame = dst[offset : offset + size]
            crc = copy_with_checksum(algo, [memoryview(src[offset : offset + size])], [frame])
            if verify and checksum_of(algo, [memoryview(frame)]) != crc:
                raise AssertionError("the one-copy baseline's checksums differ")
        samples.append(total_bytes / (time.perf_counter() - start) / 1e9)
    del dst, frame  # views pin the mapping
    mapping.close()
    return samples


def memcpy_baselines(sizes: dict[str, int], total_bytes: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Samples of every in-process baseline, by baseline and size; the one-copy work with
    CRC32C (the checksum before ISA-L's CRC-32) at 16 MiB only."""
    from kvstore.transfer.frames import ChecksumAlgo

    big = {name: size for name, size in sizes.items() if name == "16MiB"}
    return {
        "one_copy_sender_crc32c": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=False, algo=ChecksumAlgo.CRC32C)
            for name, size in big.items()
        },
        "one_copy_serial_crc32c": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=True, algo=ChecksumAlgo.CRC32C)
            for name, size in big.items()
        },
        "memcpy_numpy_copyto": {name: memcpy_gbps(size, total_bytes, repeats) for name, size in sizes.items()},
        "memcpy_streaming": {name: streaming_memcpy_gbps(size, total_bytes, repeats) for name, size in sizes.items()},
        "one_copy_sender": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=False) for name, size in sizes.items()
        },
        "one_copy_serial": {
            name: one_copy_gbps(size, total_bytes, repeats, verify=True) for name, size in sizes.items()
        },
    }


def socket_receiver(total_bytes: int, samples: int) -> None:
    """Child: accepts one loopback connection (its port is the first stdout line), then
    ``samples`` times receives ``total_bytes`` into one buffer and answers one byte."""
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    view = memoryview(bytearray(total_bytes))
    for _ in range(samples):
        got = 0
        while got < total_bytes:
            n = conn.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the sender closed early")
            got += n
        conn.sendall(b"k")
    conn.close()
    server.close()


def socket_sender_gbps(port: int, sizes: dict[str, int], total_bytes: int, repeats: int) -> dict[str, list[float]]:
    """This process's side of the socket ceiling: per size, ``repeats`` samples of
    ``total_bytes`` in ``sendall`` calls of that size, each timed until the receiver's byte
    (one warm-up sample first). The receiver must expect ``(len(sizes) * repeats + 1)``."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    source = memoryview(np.ones(total_bytes, dtype=np.uint8))
    out: dict[str, list[float]] = {}
    try:
        for name, size in [("warmup", 1 << 20), *sizes.items()]:
            for _ in range(1 if name == "warmup" else repeats):
                start = time.perf_counter()
                for offset in range(0, total_bytes, size):
                    conn.sendall(source[offset : offset + size])
                if conn.recv(1) != b"k":
                    raise ConnectionError("the socket receiver did not answer")
                if name != "warmup":
                    out.setdefault(name, []).append(total_bytes / (time.perf_counter() - start) / 1e9)
    finally:
        conn.close()
    return out


# ---- the UCX ceiling ------------------------------------------------------------------------------
_ACK_TAG = 1 << 62  # + the sample's number: the receiver's "all landed"
ONE_AT_A_TIME = "one_at_a_time"  # the receive pattern of the ucx backend's receiver


def ucx_ceiling_child(role: str, spec: dict) -> None:
    """One end of the UCX ceiling: tag messages of each size in ``spec["sizes"]`` between two
    processes over one endpoint pair, with the ucx backend's UCX (``ensure_ucx`` with the
    default ``TransferConfig``: its options, progress thread and futures), and no control
    connection, header or admission. Every sample moves ``spec["total_bytes"]``; the sender
    keeps as many sends in flight as the backend's credit allows (``max_inflight_bytes``) and
    times each sample until the receiver's one-tag answer that all of it landed. The receiver
    takes a sample one of two ways, alternating:

    - posted ahead: all of the sample's receives at once (every frame admitted ahead, no
      checksum): the most UCX moves here;
    - one at a time (``ONE_AT_A_TIME``): each receive posted once the one before has landed
      and been checksummed where it landed, as the backend's receiver does (it admits a
      frame's header, then posts its body's receive): a large message's rendezvous waits for
      its receive, so what lies between two frames idles the link.

    One 1 MiB warm-up sample first, as ``bench_backend`` sends. The receiver prints
    ``{"address"}`` (its worker's, hex), reads the sender's on stdin, prints nothing more and
    ends at its stdin's end; the sender (given the receiver's in ``spec["address"]``) prints its
    own, then ``{size name or "<size name>/one_at_a_time": [GB/s per sample]}``."""
    from kvstore.transfer.base import TransferConfig
    from kvstore.transfer.direct import checksum_of
    from kvstore.transfer.ucx import ensure_ucx, shutdown_ucx, ucxx

    config = TransferConfig()  # ensure_ucx runs on the loop: ucxx's futures belong to the loop it saw
    total = spec["total_bytes"]
    plan = [("warmup", 1 << 20)] + [(key, size) for name, size in spec["sizes"].items()
                                     for _ in range(spec["repeats"]) for key in (name, f"{name}/{ONE_AT_A_TIME}")]

    async def endpoint(address_hex: str):
        ensure_ucx(config)
        ucxx.continuous_ucx_progress()
        return await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(bytes.fromhex(address_hex)))

    async def receive() -> None:
        ensure_ucx(config)
        print(json.dumps({"address": bytes(ucxx.get_worker_address()).hex()}), flush=True)
        ep = await endpoint(sys.stdin.readline().strip())
        pages, ack, tag = np.empty(total, dtype=np.uint8), np.ones(1, dtype=np.uint8), 0
        for i, (key, size) in enumerate(plan):
            receives = []
            for offset in range(0, total, size):
                into = pages[offset : offset + size]
                if key.endswith(ONE_AT_A_TIME):
                    await ep.recv(into, tag=tag, force_tag=True)
                    checksum_of(config.checksum, [memoryview(into)])
                else:
                    receives.append(ep.recv(into, tag=tag, force_tag=True))
                tag += 1
            await asyncio.gather(*receives)
            await ep.send(ack, tag=_ACK_TAG + i, force_tag=True)
        sys.stdin.readline()  # the parent's end of the run (EOF), so the last answer is surely out
        await ep.close()
        shutdown_ucx()  # on the loop ucxx's notifier thread serves (at exit it would wait on a closed one)

    async def send() -> dict[str, list[float]]:
        ep = await endpoint(spec["address"])
        print(json.dumps({"address": bytes(ucxx.get_worker_address()).hex()}), flush=True)
        source, ack, tag = np.ones(total, dtype=np.uint8), np.empty(1, dtype=np.uint8), 0
        out: dict[str, list[float]] = {}
        for i, (key, size) in enumerate(plan):
            in_flight = max(1, config.max_inflight_bytes // size)
            start = time.perf_counter()
            sends: set[asyncio.Future] = set()
            for offset in range(0, total, size):
                if len(sends) >= in_flight:
                    _, sends = await asyncio.wait(sends, return_when=asyncio.FIRST_COMPLETED)
                sends.add(asyncio.ensure_future(ep.send(source[offset : offset + size], tag=tag, force_tag=True)))
                tag += 1
            await asyncio.gather(*sends)
            await ep.recv(ack, tag=_ACK_TAG + i, force_tag=True)
            if key != "warmup":
                out.setdefault(key, []).append(total / (time.perf_counter() - start) / 1e9)
        await ep.close()
        shutdown_ucx()
        return out

    if role == "recv":
        asyncio.run(receive())
    else:
        print(json.dumps(asyncio.run(send())), flush=True)
