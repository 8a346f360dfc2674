"""The baselines of ``bench.transfer`` measured between child processes, and how it runs its
children (``Child``: ``python -m bench.transfer --child-...``, the first stdout line a JSON report):

- the socket ceiling: a bare loopback TCP stream between two processes (``sendall`` /
  ``recv_into``, no framing, no checksum), the most any TCP transfer here can move;
- the UCX ceiling: bare UCX tag messages between two processes with the ucx backend's UCX
  (``ucx_ceiling_child``), with every receive posted ahead and one at a time;
- Mooncake's TransferEngine over TCP, the peer baseline, when
  ``mooncake-transfer-engine-non-cuda`` is installed.

The in-process baselines (memory copies, the one-copy shm work) are ``bench.transfer_baselines``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore.transfer.tcp import SOCKET_BUFFER_BYTES  # the tcp backend's kernel buffers

SIZES_BYTES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
MOONCAKE_SIZES = ("1MiB", "16MiB")
REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 120.0


def summarize(gbps: list[float]) -> dict:
    median = statistics.median(gbps)
    return {
        "median_gbps": round(median, 3),
        "min_gbps": round(min(gbps), 3),
        "max_gbps": round(max(gbps), 3),
        "spread_pct": round(100 * (max(gbps) - min(gbps)) / median, 1),
        "repeats": len(gbps),
    }


class Child:
    """A child ``python -m bench.transfer --child-...``; the first stdout line is its JSON report.
    Killed on exit."""

    def __init__(self, *args: str):
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.transfer", *args],
            cwd=REPO_ROOT,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            },
        )

    def report(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=CHILD_TIMEOUT_S)
            self.stderr.seek(0)
            tail = self.stderr.read().strip().splitlines()[-3:]
            raise RuntimeError(f"child exited {self.proc.returncode}: {' | '.join(tail)}")
        return json.loads(line)

    def finish(self) -> int:
        """Ends the child (its stdin closed; killed after ``CHILD_TIMEOUT_S``); its exit code."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()
        return self.proc.returncode


# ---- the socket ceiling -------------------------------------------------------------------------


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


def bench_socket(repeats: int, total_bytes: int) -> dict:
    """The socket ceiling (``socket_sender_gbps`` to a ``socket_receiver`` child) for the sizes
    Mooncake is measured at."""
    sizes = {name: SIZES_BYTES[name] for name in MOONCAKE_SIZES}
    receiver = Child("--child-socket", str(total_bytes), str(len(sizes) * repeats + 1))
    try:
        samples = socket_sender_gbps(int(receiver.report()), sizes, total_bytes, repeats)
    finally:
        receiver.finish()
    return {"what": "sendall / recv_into over one loopback TCP connection, no framing or checksum",
            **{name: summarize(gbps) for name, gbps in samples.items()}}


# ---- the UCX ceiling ----------------------------------------------------------------------------
_ACK_TAG = 1 << 62  # + the sample's number: the receiver's "all landed"
ONE_AT_A_TIME = "one_at_a_time"  # the receive pattern of the ucx backend's receiver


def ucx_ceiling_child(role: str, spec: dict) -> None:
    """One end of the UCX ceiling: tag messages of each size in ``spec["sizes"]`` between two
    processes over one endpoint pair, with the ucx backend's UCX (``ensure_ucx`` with the
    default ``TransferConfig``: its options, progress thread and futures), and no control
    connection, header or admission. Every sample moves ``spec["total_bytes"]``; the sender
    keeps as many sends in flight as the measured backend's credit allows
    (``spec["inflight_bytes"]``, its ``max_inflight_bytes``) and times each sample until the
    receiver's one-tag answer that all of it landed. The receiver takes a sample one of two
    ways, alternating:

    - posted ahead: all of the sample's receives at once (every frame admitted ahead, no
      checksum): the most UCX moves here;
    - one at a time (``ONE_AT_A_TIME``): each receive posted once the one before has landed
      and been checksummed where it landed, as the backend's receiver did before it read
      ahead (``kvstore.transfer.landing``; it now posts a body's receive as soon as it has
      admitted the header, bounded by the sender's in-flight credit): a large message's
      rendezvous waits for its receive, so what lies between two frames idles the link.

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
            in_flight = max(1, spec["inflight_bytes"] // size)
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


def bench_ucx_ceiling(repeats: int, total_bytes: int, inflight_bytes: int) -> tuple[dict, dict]:
    """The UCX ceiling (``ucx_ceiling_child``) for the sizes Mooncake is measured at, with
    every receive posted ahead and one at a time, the sender's in-flight bound the measured
    backend's (``inflight_bytes``): a receiver child and a sender child, their worker addresses
    passed between them."""
    from kvstore.transfer import ucx_unavailable_reason

    reason = ucx_unavailable_reason()
    if reason is not None:
        return {"skipped": reason}, {"skipped": reason}
    spec = {"total_bytes": total_bytes, "repeats": repeats, "inflight_bytes": inflight_bytes,
            "sizes": {name: SIZES_BYTES[name] for name in MOONCAKE_SIZES}}
    receiver = Child("--child-ucx-ceiling", "recv", json.dumps(spec))
    sender, exits = None, []
    try:
        address = receiver.report()["address"]
        sender = Child("--child-ucx-ceiling", "send", json.dumps({**spec, "address": address}))
        receiver.proc.stdin.write(sender.report()["address"] + "\n")
        receiver.proc.stdin.flush()
        samples = sender.report()
    except RuntimeError as exc:
        failed = {"skipped": f"the ucx ceiling failed: {exc}"}
        return failed, failed
    finally:
        exits = [child.finish() for child in (sender, receiver) if child is not None]
    ahead = {"what": "UCX tag messages over one endpoint pair, every receive posted ahead, no framing or checksum",
             "exit_codes": exits}  # sender, receiver: 0 when both shut ucxx down and ended
    one = {"what": "the same, each receive posted once the one before landed and was checksummed"}
    for key, gbps in samples.items():
        name, _, pattern = key.partition("/")
        (one if pattern == ONE_AT_A_TIME else ahead)[name] = summarize(gbps)
    return ahead, one


# ---- Mooncake's TransferEngine ------------------------------------------------------------------


def child_mooncake(role: str, arg: str) -> None:
    """Mooncake TransferEngine over TCP with a P2P handshake (no metadata server needed)."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    if role == "recv":
        region = np.zeros(int(arg), dtype=np.uint8)
        if engine.register_memory(region.ctypes.data, region.nbytes) != 0:
            raise RuntimeError("register_memory failed")
        print(json.dumps({"port": engine.get_rpc_port(), "ptr": region.ctypes.data}), flush=True)
        sys.stdin.readline()
        return
    spec = json.loads(arg)
    source = np.ones(spec["total_bytes"], dtype=np.uint8)
    if engine.register_memory(source.ctypes.data, source.nbytes) != 0:
        raise RuntimeError("register_memory failed")
    target = f"127.0.0.1:{spec['port']}"
    results = {}
    for name in ["1MiB", *MOONCAKE_SIZES]:  # the first 1 MiB pass warms the connection up
        size = SIZES_BYTES[name]
        offsets = list(range(0, spec["total_bytes"], size))
        samples = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            status = engine.batch_transfer_sync_write(
                target,
                [source.ctypes.data + o for o in offsets],
                [spec["ptr"] + o for o in offsets],
                [size] * len(offsets),
            )
            elapsed = time.perf_counter() - start
            if status != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {status}")
            samples.append(spec["total_bytes"] / elapsed / 1e9)
        results[name] = summarize(samples)
    print(json.dumps(results), flush=True)


def bench_mooncake(repeats: int, total_bytes: int) -> dict:
    if importlib.util.find_spec("mooncake") is None:
        return {"skipped": "mooncake-transfer-engine-non-cuda is not installed"}
    receiver = Child("--child-mooncake", "recv", str(total_bytes))
    try:
        target = receiver.report()
        spec = {**target, "total_bytes": total_bytes, "repeats": repeats}
        sender = Child("--child-mooncake", "send", json.dumps(spec))
        try:
            return {"protocol": "tcp", "handshake": "P2PHANDSHAKE", **sender.report()}
        finally:
            sender.finish()
    except RuntimeError as exc:
        return {"skipped": f"mooncake failed: {exc}"}
    finally:
        receiver.finish()
