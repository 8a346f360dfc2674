"""Benchmark of the tiered block store against Redis and Mooncake Store; prints JSON.

Owns one measurement: put then get of N distinct blocks of a realistic payload size, repeated,
for each backend, reporting MB/s and ops/s per phase as the median with min/max over repeats.

- ``tidekv_dram``: ``TieredStore.put(payload)`` / ``try_get`` on a DRAM-only store; includes
  encoding (CRC-32 over the body) and decoding (one copy into caller-owned tensors).
- ``tidekv_dram_encoded``: ``put_encoded`` / ``try_get_encoded``, bytes in and out as a peer
  transfer uses them; the put verifies the CRC, the get hands out the stored bytes.
- ``tidekv_ssd`` / ``tidekv_ssd_nofsync``: SSD-only store (temp file, fsync, rename, dir
  fsync / the same without fsyncs); gets read back and verify. Reads are served by the OS page
  cache here, so they measure the software path, not the device.
- ``redis``: SET/GET of the same encoded bytes with redis-py against a ``redis-server`` this
  script starts on 127.0.0.1 (no persistence) and stops.
- ``mooncake``: ``MooncakeDistributedStore.put``/``get`` of the same bytes (TCP transport on
  loopback, master on 127.0.0.1), when ``mooncake-transfer-engine-non-cuda`` imports;
  otherwise ``{"skipped": reason}``.

Run: ``python -m bench.store [--repeats N]``. Bounded: about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from deploy.local import free_port
from kvstore.blocks import ROOT_KEY, BlockKey, Tier, block_key
from kvstore.payload import BlockPayload, make_random_payload
from kvstore.payload_format import encode
from kvstore.store import StoreConfig, TieredStore

FP = "bench-model"
MIB = 1 << 20
START_DEADLINE_S = 20.0


@dataclasses.dataclass(frozen=True)
class PayloadShape:
    """An MLA-only block: ``num_layers x block_size x latent_dim`` fp32 values."""

    name: str
    num_layers: int
    block_size: int
    latent_dim: int
    num_ops: int  # blocks put and got per repeat
    num_ssd_ops: int  # fewer on SSD: every fsynced write costs milliseconds

    @property
    def tensor_bytes(self) -> int:
        return self.num_layers * self.block_size * self.latent_dim * 4


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    repeats: int = 5
    shapes: tuple[PayloadShape, ...] = (
        PayloadShape("64KiB", num_layers=4, block_size=16, latent_dim=256, num_ops=200, num_ssd_ops=40),
        PayloadShape("1MiB", num_layers=8, block_size=64, latent_dim=512, num_ops=48, num_ssd_ops=16),
        PayloadShape("16MiB", num_layers=8, block_size=512, latent_dim=1024, num_ops=6, num_ssd_ops=3),
    )


@dataclasses.dataclass(frozen=True)
class Workload:
    keys: list[BlockKey]
    payloads: list[BlockPayload]
    blobs: list[bytes]

    @property
    def blob_bytes(self) -> int:
        return len(self.blobs[0])


# A backend run: given a workload, returns (put seconds, get seconds) for all its blocks.
Runner = Callable[[Workload], tuple[float, float]]


def make_workload(shape: PayloadShape, num_ops: int, salt: int) -> Workload:
    gen = torch.Generator().manual_seed(salt)
    layer_ids = tuple(range(shape.num_layers))
    payloads = [
        make_random_payload(
            gen,
            model_fingerprint=FP,
            mla_layer_ids=layer_ids,
            block_size=shape.block_size,
            latent_dim=shape.latent_dim,
        )
        for _ in range(num_ops)
    ]
    keys = [block_key(ROOT_KEY, [salt, i], FP, cache_salt=shape.name) for i in range(num_ops)]
    return Workload(keys, payloads, [encode(p) for p in payloads])


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _check(ok: bool, what: str) -> bool:
    if not ok:
        raise RuntimeError(f"benchmark step failed: {what}")
    return ok


# ----- Tidekv ------------------------------------------------------------------------------


def _put_get(w: Workload, put: Callable[[int], bool], get: Callable[[int], bool]) -> tuple[float, float]:
    """Time ``put(i)`` then ``get(i)`` for every block ``i`` of ``w``; each must return True."""
    indices = range(len(w.keys))
    put_s = _timed(lambda: all(_check(put(i), "put") for i in indices))
    get_s = _timed(lambda: all(_check(get(i), "get") for i in indices))
    return put_s, get_s


def tidekv_runner(tier: Tier, encoded: bool, scratch: Path, fsync: bool = True) -> Runner:
    def run(w: Workload) -> tuple[float, float]:
        capacity = 2 * w.blob_bytes * len(w.keys)
        ssd_dir = Path(tempfile.mkdtemp(dir=scratch))
        config = StoreConfig(
            FP,
            dram_capacity_bytes=capacity if tier is Tier.DRAM else 0,
            ssd_capacity_bytes=capacity if tier is Tier.SSD else 0,
            ssd_dir=str(ssd_dir),
            promote_to=tier,
            ssd_fsync=fsync,
        )
        try:
            with TieredStore(config) as s:
                if encoded:
                    return _put_get(
                        w,
                        lambda i: s.put_encoded(w.keys[i], w.blobs[i], tier),
                        lambda i: s.try_get_encoded(w.keys[i]) is not None,
                    )
                return _put_get(
                    w, lambda i: s.put(w.keys[i], w.payloads[i], tier), lambda i: s.try_get(w.keys[i]) is not None
                )
        finally:
            shutil.rmtree(ssd_dir)

    return run


# ----- Redis -------------------------------------------------------------------------------



def _wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline_s = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} at start")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {START_DEADLINE_S}s")
        time.sleep(0.05)  # start-up only, never in a measured loop


@contextlib.contextmanager
def _process(argv: Sequence[str], port: int, what: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(port, proc, what)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=START_DEADLINE_S)


@contextlib.contextmanager
def redis_runner(scratch: Path) -> Iterator[Runner | str]:
    """A runner against a private redis-server, or the reason there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield "redis-server not on PATH (Debian package redis-server)"
        return
    import redis

    port = free_port()
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    with _process(argv + ["--dir", str(scratch)], port, "redis-server", scratch / "redis.log"):
        client = redis.Redis(host="127.0.0.1", port=port)

        def run(w: Workload) -> tuple[float, float]:
            times = _put_get(
                w, lambda i: bool(client.set(w.keys[i], w.blobs[i])), lambda i: client.get(w.keys[i]) is not None
            )
            client.delete(*w.keys)
            return times

        try:
            yield run
        finally:
            client.close()


# ----- Mooncake ----------------------------------------------------------------------------


@contextlib.contextmanager
def mooncake_runner(scratch: Path) -> Iterator[Runner | str]:
    """A runner against Mooncake Store (master + in-process client on 127.0.0.1), or the reason
    it cannot run."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        yield f"mooncake-transfer-engine-non-cuda does not import: {e}"
        return
    master = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not Path(master).exists():
        yield "mooncake_master binary not found next to the interpreter or on PATH"
        return
    rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    argv = [
        master,
        f"--rpc_port={rpc_port}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http_port}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics_port}",
    ]
    with _process(argv, rpc_port, "mooncake_master", scratch / "mooncake_master.log"):
        store = MooncakeDistributedStore()
        metadata = f"http://127.0.0.1:{http_port}/metadata"
        rc = store.setup("127.0.0.1", metadata, 2048 * MIB, 128 * MIB, "tcp", "", f"127.0.0.1:{rpc_port}")
        if rc != 0:
            yield f"MooncakeDistributedStore.setup returned {rc}"
            return

        def run(w: Workload) -> tuple[float, float]:
            # Keys are never reused, so objects still under their read lease (remove() refuses
            # them) cannot shadow a later run; they age out of the segment by eviction.
            names = [k.hex() for k in w.keys]
            times = _put_get(
                w, lambda i: store.put(names[i], w.blobs[i]) == 0, lambda i: len(store.get(names[i])) == w.blob_bytes
            )
            for name in names:
                store.remove(name)
            return times

        try:
            yield run
        finally:
            store.close()


# ----- measurement -------------------------------------------------------------------------


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def measure(run: Runner, shape: PayloadShape, num_ops: int, repeats: int) -> dict[str, object]:
    """Median and spread of put/get throughput over ``repeats`` runs, each on fresh keys."""
    run(make_workload(shape, min(num_ops, 4), salt=10_000))  # warm-up: imports, first allocations
    phases: dict[str, dict[str, list[float]]] = {p: {"mb_per_s": [], "ops_per_s": []} for p in ("put", "get")}
    blob_bytes = 0
    for r in range(repeats):
        workload = make_workload(shape, num_ops, salt=r)
        blob_bytes = workload.blob_bytes
        for phase, seconds in zip(("put", "get"), run(workload), strict=True):
            phases[phase]["mb_per_s"].append(num_ops * blob_bytes / seconds / 1e6)
            phases[phase]["ops_per_s"].append(num_ops / seconds)
    result: dict[str, object] = {"num_ops": num_ops, "repeats": repeats, "bytes_per_op": blob_bytes}
    for phase, series in phases.items():
        result[phase] = {name: _summary(values) for name, values in series.items()}
    return result


def _ratio(results: dict[str, dict], a: str, b: str, phase: str) -> float | None:
    if "skipped" in results.get(a, {"skipped": 1}) or "skipped" in results.get(b, {"skipped": 1}):
        return None
    return round(results[a][phase]["ops_per_s"]["median"] / results[b][phase]["ops_per_s"]["median"], 2)


def _redis_client_info() -> dict[str, object]:
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    return {"redis_py": redis.__version__, "hiredis_parser": HIREDIS_AVAILABLE}


def run_bench(config: BenchConfig) -> dict[str, object]:
    started_s = time.perf_counter()
    out: dict[str, object] = {
        "bench": "kvstore.store",
        "torch_threads": torch.get_num_threads(),
        "notes": [
            "tidekv runs in-process; redis and mooncake add a loopback TCP hop per op",
            "tidekv_dram put/get include encode (CRC-32) / decode (one copy into new tensors)",
            "ssd gets are served from the OS page cache",
            "median/min/max are over repeats, each on fresh keys",
        ],
        "redis_client": _redis_client_info(),
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="tidekv-bench-") as tmp, contextlib.ExitStack() as stack:
        scratch = Path(tmp)
        runners: dict[str, Runner | str] = {
            "tidekv_dram": tidekv_runner(Tier.DRAM, encoded=False, scratch=scratch),
            "tidekv_dram_encoded": tidekv_runner(Tier.DRAM, encoded=True, scratch=scratch),
            "tidekv_ssd": tidekv_runner(Tier.SSD, encoded=False, scratch=scratch),
            "tidekv_ssd_nofsync": tidekv_runner(Tier.SSD, encoded=False, scratch=scratch, fsync=False),
            "redis": stack.enter_context(redis_runner(scratch)),
            "mooncake": stack.enter_context(mooncake_runner(scratch)),
        }
        for shape in config.shapes:
            per_backend: dict[str, dict] = {}
            for name, runner in runners.items():
                if isinstance(runner, str):
                    per_backend[name] = {"skipped": runner}
                    continue
                num_ops = shape.num_ssd_ops if name.startswith("tidekv_ssd") else shape.num_ops
                per_backend[name] = measure(runner, shape, num_ops, config.repeats)
            per_backend["ratios_ops_per_s"] = {
                f"{a}_vs_{b}_{phase}": _ratio(per_backend, a, b, phase)
                for a, b in (
                    ("tidekv_dram", "redis"),
                    ("tidekv_dram_encoded", "redis"),
                    ("tidekv_dram", "mooncake"),
                )
                for phase in ("put", "get")
            }
            out["results"][shape.name] = {"tensor_bytes": shape.tensor_bytes, **per_backend}
    out["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(run_bench(BenchConfig(repeats=args.repeats)), indent=2))


if __name__ == "__main__":
    main()
