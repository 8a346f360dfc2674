"""Transfer engine throughput between two processes, per backend and chunk size, against a plain
memory copy of the same bytes measured in the same run; Mooncake's TransferEngine over TCP is
the peer baseline when ``mooncake-transfer-engine-non-cuda`` is installed. Prints one JSON
object. Bounded to about two minutes on two cores.

What one sample measures: the sender (this process) pushes ``--mib-per-repeat`` MiB as BLOB
chunks of one size to a receiver child and calls ``finish``; the clock stops when the receiver's
verdict arrives, i.e. every chunk was checksummed on both sides and copied into the receiver's
destination tensor. GB/s are 1e9 bytes per second.

    python -m bench.transfer [--repeats 5] [--mib-per-repeat 64] [--backends shm,tcp,ucx]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

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


def bench_config():
    from kvstore.transfer import TransferConfig

    return TransferConfig(deadline_s=CHILD_TIMEOUT_S, max_frame_bytes=16 << 20, max_inflight_bytes=64 << 20)


def plan(repeats: int, total_bytes: int) -> list[tuple[str, int, int]]:
    """Requests a receiver must expect: (request id, number of blobs, blob bytes)."""
    requests = [("warmup", 8, 1 << 20)]
    for name, size in SIZES_BYTES.items():
        requests += [(f"{name}-{r}", total_bytes // size, size) for r in range(repeats)]
    return requests


# ---- child processes --------------------------------------------------------------------------


def child_receive(backend: str, requests: list[tuple[str, int, int]]) -> None:
    """Receiver child: expects every planned request into one destination buffer.

    The sink copies with numpy (one plain memcpy, like the baseline): torch's ``copy_`` fans out
    to OpenMP threads whose spin-waits swing wildly on a loaded two-core machine."""
    from kvstore.transfer import Expected, Receiver

    destination = np.empty(max(size for _, _, size in requests), dtype=np.uint8)

    class CopySink:
        def write(self, kind, layer, token_start, token_end, tensor) -> None:
            np.copyto(destination[: tensor.numel()], tensor.numpy())

    receiver = Receiver(bench_config(), backends=backend)
    for rid, num_blobs, size in requests:
        receiver.expect(rid, CopySink(), Expected(num_blobs=num_blobs, max_blob_bytes=size))
    print(json.dumps({"address": receiver.address}), flush=True)
    for rid, _, _ in requests:
        receiver.wait_complete(rid)
    receiver.close()


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


# ---- parent -------------------------------------------------------------------------------------


class Child:
    """A child of this script; the first stdout line is its JSON report. Killed on exit."""

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

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def memcpy_gbps(size: int, total_bytes: int, repeats: int) -> list[float]:
    """``numpy.copyto`` of ``total_bytes`` in ``size`` pieces, like the receiver's sink."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    count = total_bytes // size
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            np.copyto(dst, src)
        samples.append(count * size / (time.perf_counter() - start) / 1e9)
    return samples


def send_request(tx, rid: str, num_blobs: int, chunk: np.ndarray) -> float:
    from kvstore.transfer import Kind

    start = time.perf_counter()
    for index in range(num_blobs):
        tx.send(rid, index, Kind.BLOB, (0, 0), chunk)
    tx.finish(rid, num_blobs)
    return time.perf_counter() - start


def bench_backend(backend: str, repeats: int, total_bytes: int) -> dict:
    from kvstore.transfer import connect

    requests = plan(repeats, total_bytes)
    child = Child("--child-receive", backend, json.dumps(requests))
    try:
        tx = connect(child.report()["address"], bench_config())
        source = np.ones(max(size for _, _, size in requests), dtype=np.uint8)
        samples: dict[str, list[float]] = {}
        for rid, num_blobs, size in requests:
            elapsed_s = send_request(tx, rid, num_blobs, source[:size])
            if rid != "warmup":
                samples.setdefault(rid.rsplit("-", 1)[0], []).append(num_blobs * size / elapsed_s / 1e9)
        tx.close()
    finally:
        child.finish()
    return {name: summarize(gbps) for name, gbps in samples.items()}


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


def with_ratios(results: dict, memcpy: dict) -> dict:
    for name, row in results.items():
        if name in memcpy and isinstance(row, dict) and "median_gbps" in row:
            row["ratio_to_memcpy"] = round(row["median_gbps"] / memcpy[name]["median_gbps"], 3)
    return results


def run(args: argparse.Namespace) -> dict:
    from kvstore.transfer import ucx_unavailable_reason
    from kvstore.transfer.frames import default_checksum_algo

    total_bytes = args.mib_per_repeat << 20
    memcpy = {name: summarize(memcpy_gbps(size, total_bytes, args.repeats)) for name, size in SIZES_BYTES.items()}
    report: dict = {
        "bytes_per_sample": total_bytes,
        "checksum": default_checksum_algo().name.lower(),
        "memcpy_numpy_copyto": memcpy,
        "backends": {},
    }
    for backend in args.backends.split(","):
        reason = ucx_unavailable_reason() if backend == "ucx" else None
        if reason is not None:
            report["backends"][backend] = {"skipped": reason}
            continue
        report["backends"][backend] = with_ratios(bench_backend(backend, args.repeats, total_bytes), memcpy)
    report["mooncake"] = with_ratios(bench_mooncake(args.repeats, total_bytes), memcpy)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mib-per-repeat", type=int, default=64)
    parser.add_argument("--backends", default="shm,tcp,ucx")
    parser.add_argument("--child-receive", nargs=2, metavar=("BACKEND", "PLAN"), help=argparse.SUPPRESS)
    parser.add_argument("--child-mooncake", nargs=2, metavar=("ROLE", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_receive:
        child_receive(args.child_receive[0], json.loads(args.child_receive[1]))
    elif args.child_mooncake:
        child_mooncake(*args.child_mooncake)
    else:
        started = time.perf_counter()
        report = run(args)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
