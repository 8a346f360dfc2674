"""Transfer engine throughput between two processes, per backend and chunk size, against
baselines measured in the same run: ``memcpy_numpy_copyto`` copies between the same two
buffers of the chunk size (the issue's baseline, cache-resident), ``memcpy_streaming`` copies
exactly the bytes a sample moves (distinct source and destination, in one process). Two more
bound the direct shm path by its own work, without the transfer: ``one_copy_sender`` is the
sender's (``copy_with_checksum`` of the same bytes into shareable memory: the bound when the
receiver's checksum pass overlaps on a free core) and ``one_copy_serial`` adds the receiver's
pass over the destination in the same thread (the bound when both ends share one core); the
``*_crc32c`` ones do the same with CRC32C, the checksum before ISA-L's CRC-32. Mooncake's
TransferEngine over TCP is a peer baseline when ``mooncake-transfer-engine-non-cuda`` is
installed (set ``MC_TCP_BIND_ADDRESS=127.0.0.1``), and ``socket_ceiling`` (a bare loopback TCP
stream between two processes, no framing or checksum) bounds every TCP transfer here, as
``ucx_ceiling`` (bare UCX tag messages between two processes with the ucx backend's UCX
options, every receive posted ahead, no framing or checksum; measured with the ucx backend)
bounds the ucx one; ``ucx_one_at_a_time`` is the same with each receive posted once the one
before has landed and been checksummed, the pattern of the backend's receiver before it read
ahead (it now posts each body's receive once it has admitted the header). The in-process
baselines live in ``bench.transfer_baselines``; the ceilings and Mooncake, measured between
child processes, in ``bench.transfer_peers``.

The whole set runs ``--rounds`` times (the backends' order rotating), and every goal row is
the median over rounds of that round's ratio (both sides measured minutes apart at most), with
its extremes and each round's value: the machine is shared, so a single ratio means little.
``goals`` holds the issue's rows (ucx / tcp at 64 KiB and 16 MiB; shm 16 MiB / cache-resident
memcpy, also with the transfer's own bytes cache-resident, ``shm-resident``: one 16 MiB frame
per sample into a 16 MiB pool, after ``RESIDENT_WARMUPS`` passes over it, in steady state as
the memcpy is; tcp 16 MiB / socket ceiling) and the integrity options side by
side (``shm-crc32c`` / ``shm``). ``medians_gbps`` has every backend's and baseline's median
over rounds, ``last_round`` the last round in full. Bounded to a few minutes on two cores.

What one sample measures: the sender (this process) pushes ``--mib-per-repeat`` MiB of one
MLA layer's rows (1 KiB each, a decode worker's destination: a paged pool of 64-row pages, as a
``PagePoolSink``) in chunks of one size to a receiver child and calls ``finish``; the clock
stops when the receiver's verdict arrives, i.e. every chunk was checksummed on both sides and
is in the receiver's pages. Backends: ``shm`` (the pool in shareable memory: the sender writes
into it directly, one copy), ``shm-ring`` (a private pool: through the ring, two copies),
``tcp`` (received straight into the pages), ``ucx``; variants ``tcp-auth`` (authenticated),
``tcp-encrypted`` (authenticated and AES-256-GCM, as ``--tls`` makes it; ``bench.security``
compares the two) and ``*-crc32c``. GB/s are 1e9 bytes per second. Per backend and size,
``cores_busy`` is the median of (sender + receiver CPU seconds) / wall seconds of a sample:
near 1 the two ends ran one after the other (no free second core: ``one_copy_serial`` bounds
the transfer), near 2 they overlapped. ``frames_direct`` counts the receiver's data frames
written straight into its pages by an shm sender, and ``loadavg`` is the host's load.

    python -m bench.transfer [--rounds 3] [--repeats 5] [--mib-per-repeat 64]
        [--backends shm,shm-crc32c,shm-ring,tcp,ucx] [--no-resident]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

from bench.transfer_baselines import memcpy_baselines
from bench.transfer_peers import (
    CHILD_TIMEOUT_S,
    SIZES_BYTES,
    Child,
    bench_mooncake,
    bench_socket,
    bench_ucx_ceiling,
    child_mooncake,
    socket_receiver,
    summarize,
    ucx_ceiling_child,
)

ROW_FLOATS = 256  # 1 KiB rows of float32
# Passes over the 16 MiB pool before the resident row's samples: on these machines the first
# writes of a process into a freshly mapped pool run several times slower than steady state
# and take about eight passes to reach it (a plain copy_with_checksum loop shows the same);
# a serving connection, like the memcpy baseline, is long past that.
RESIDENT_WARMUPS = 12
PAGE_ROWS = 64  # 64 KiB pages


def variant(backend: str) -> tuple[str, frozenset[str]]:
    """A backend name's scheme and variants: ``shm-ring`` (a private pool: through the ring),
    ``tcp-auth`` (authenticated), ``tcp-encrypted`` (authenticated and encrypted, as ``--tls``
    makes it), ``*-crc32c`` (frames checksummed with CRC32C instead of the default)."""
    scheme, *rest = backend.split("-")
    return scheme, frozenset(rest)


def needs_key(backend: str) -> bool:
    return bool(variant(backend)[1] & {"auth", "encrypted"})


def bench_config(backend: str = "tcp", key: bytes = b""):
    from kvstore.transfer import ChecksumAlgo, TransferConfig
    from kvstore.transfer.frames import default_checksum_algo

    flags = variant(backend)[1]
    algo = ChecksumAlgo.CRC32C if "crc32c" in flags else default_checksum_algo()
    return TransferConfig(deadline_s=CHILD_TIMEOUT_S, max_frame_bytes=16 << 20, max_inflight_bytes=64 << 20,
                          checksum=algo, auth_key=key if needs_key(backend) else b"", encrypt="encrypted" in flags)


def plan(repeats: int, total_bytes: int, sizes: dict[str, int] = SIZES_BYTES,
         warmups: tuple[int, ...] = (1 << 20,)) -> list[tuple[str, int]]:
    """Requests a receiver must expect: (request id, chunk bytes); each carries total_bytes.
    The ``warmups`` (their chunk sizes) come first and are not samples."""
    requests = [(f"warmup-{i}", size) for i, size in enumerate(warmups)]
    for name, size in sizes.items():
        requests += [(f"{name}-{r}", size) for r in range(repeats)]
    return requests


# ---- child processes --------------------------------------------------------------------------


def child_receive(backend: str, total_bytes: int, requests: list[tuple[str, int]]) -> None:
    """Receiver child: expects every planned request into one paged pool (pages in order, as a
    fresh decode worker allocates them); shareable memory except for ``shm-ring``."""
    import torch

    from engine.memory import shareable_zeros
    from kvstore.transfer import Expected, PagePoolSink, Receiver

    torch.set_num_threads(1)  # the tcp sink's index_copy_ must not fan out to spinning OpenMP threads
    key = bytes.fromhex(sys.stdin.readline().strip()) if needs_key(backend) else b""  # never in argv
    scheme, flags = variant(backend)
    num_tokens = total_bytes // (ROW_FLOATS * 4)
    shape = (1, num_tokens // PAGE_ROWS, PAGE_ROWS, ROW_FLOATS)
    pool = torch.zeros(shape) if "ring" in flags else shareable_zeros(shape, torch.float32)
    sink = PagePoolSink(pool, torch.arange(shape[1]), {0: 0})
    expected = Expected(mla_layers=(0,), token_start=0, token_end=num_tokens, mla_row_shape=(ROW_FLOATS,))
    receiver = Receiver(bench_config(backend, key), backends=scheme)
    for rid, _ in requests:
        receiver.expect(rid, sink, expected)
    gc.freeze()  # what torch's import left is not traversed again: no full collection mid-sample
    print(json.dumps({"address": receiver.address}), flush=True)
    cpu_s, last = {}, time.process_time()
    for rid, _ in requests:
        receiver.wait_complete(rid)
        now = time.process_time()
        cpu_s[rid], last = now - last, now
    frames = {"frames": receiver.frames_received, "frames_direct": receiver.frames_direct}
    print(json.dumps({"cpu_s": cpu_s, **frames}), flush=True)
    receiver.close()


# ---- parent -------------------------------------------------------------------------------------


def send_request(tx, rid: str, rows: np.ndarray, chunk_bytes: int) -> float:
    from kvstore.transfer import Kind

    step = chunk_bytes // (ROW_FLOATS * 4)
    start = time.perf_counter()
    for t0 in range(0, len(rows), step):
        tx.send(rid, 0, Kind.MLA_ROWS, (t0, t0 + step), rows[t0 : t0 + step])
    tx.finish(rid, 1)
    return time.perf_counter() - start


def bench_backend(backend: str, repeats: int, total_bytes: int, sizes: dict[str, int] = SIZES_BYTES,
                  warmups: tuple[int, ...] = (1 << 20,)) -> dict:
    from kvstore.transfer import connect

    requests = plan(repeats, total_bytes, sizes, warmups)
    child = Child("--child-receive", backend, str(total_bytes), json.dumps(requests))
    try:
        key = os.urandom(32)
        if needs_key(backend):
            child.proc.stdin.write(key.hex() + "\n")
            child.proc.stdin.flush()
        tx = connect(child.report()["address"], bench_config(backend, key))
        rows = np.ones((total_bytes // (ROW_FLOATS * 4), ROW_FLOATS), dtype=np.float32)
        gc.collect()
        gc.freeze()  # as in the receiver child: no full collection of this process's heap mid-sample
        walls: dict[str, tuple[float, float]] = {}  # request id -> (wall s, sender cpu s)
        for rid, size in requests:
            cpu_before = time.process_time()
            elapsed_s = send_request(tx, rid, rows, size)
            walls[rid] = (elapsed_s, time.process_time() - cpu_before)
        tx.close()
        receiver = child.report()
    finally:
        gc.unfreeze()
        child.finish()
    samples: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    for rid, (wall_s, cpu_s) in walls.items():
        if not rid.startswith("warmup"):
            name = rid.rsplit("-", 1)[0]
            samples.setdefault(name, []).append(total_bytes / wall_s / 1e9)
            busy.setdefault(name, []).append((cpu_s + receiver["cpu_s"][rid]) / wall_s)
    results = {
        name: {**summarize(gbps), "cores_busy": round(statistics.median(busy[name]), 2)}
        for name, gbps in samples.items()
    }
    return {**results, "frames": receiver["frames"], "frames_direct": receiver["frames_direct"]}


def with_ratios(results: dict, memcpy: dict) -> dict:
    for name, row in results.items():
        if name in memcpy and isinstance(row, dict) and "median_gbps" in row:
            row["ratio_to_memcpy"] = round(row["median_gbps"] / memcpy[name]["median_gbps"], 3)
    return results


def _ratio(numerator: dict, denominator: dict, goal: float | None) -> dict:
    if "median_gbps" not in numerator or "median_gbps" not in denominator:
        return {"skipped": "a side of the ratio was not measured"}
    ratio = numerator["median_gbps"] / denominator["median_gbps"]
    # Spread of the ratio from the extremes of both sides (worst and best pairing).
    low, high = numerator["min_gbps"] / denominator["max_gbps"], numerator["max_gbps"] / denominator["min_gbps"]
    row = {"ratio": round(ratio, 3), "ratio_min": round(low, 3), "ratio_max": round(high, 3)}
    return row if goal is None else {**row, "goal": goal, "met": ratio >= goal}


def _ratio_per_cpu_s(numerator: dict, denominator: dict) -> dict:
    """Bytes moved per CPU second of both ends (``median_gbps / cores_busy``), numerator over
    denominator: what a byte costs each, besides how fast it went."""
    if "cores_busy" not in numerator or "cores_busy" not in denominator:
        return {"skipped": "a side of the ratio was not measured"}
    def per_cpu_s(row: dict) -> float:
        return row["median_gbps"] / row["cores_busy"]

    return {"ratio": round(per_cpu_s(numerator) / per_cpu_s(denominator), 3)}


def goals(report: dict) -> dict:
    """The issue's rows, medians side by side from this run (ratio spreads from the extremes)."""
    backends, memcpy = report["backends"], report["memcpy_numpy_copyto"]
    shm, tcp, ucx = backends.get("shm", {}), backends.get("tcp", {}), backends.get("ucx", {})
    ceiling, ucx_ceiling, ucx_one = report["socket_ceiling"], report["ucx_ceiling"], report["ucx_one_at_a_time"]
    rows = {
        "ucx_64KiB_vs_tcp_64KiB": _ratio(ucx.get("64KiB", {}), tcp.get("64KiB", {}), 0.9),
        "ucx_16MiB_vs_tcp_16MiB": _ratio(ucx.get("16MiB", {}), tcp.get("16MiB", {}), 0.9),
        "shm_16MiB_vs_memcpy": _ratio(shm.get("16MiB", {}), memcpy["16MiB"], 0.6),
        # The same with the transfer's bytes cache-resident too, as the memcpy's are.
        "shm_resident_16MiB_vs_memcpy": _ratio(backends.get("shm-resident", {}).get("16MiB", {}), memcpy["16MiB"], 0.6),
        "tcp_16MiB_vs_socket_ceiling": _ratio(tcp.get("16MiB", {}), ceiling.get("16MiB", {}), 0.9),
        "shm_64KiB_vs_shm_16MiB": _ratio(shm.get("64KiB", {}), shm.get("16MiB", {}), 0.5),
        # Not goals: what bounds the shm row (a copy of bytes that do not stay in cache, and
        # the one-copy work itself), and the integrity options measured side by side.
        "shm_16MiB_vs_streaming_memcpy": _ratio(shm.get("16MiB", {}), report["memcpy_streaming"]["16MiB"], None),
        # A plain copy of the bytes a transfer moves, no checksum, against the shm row's baseline:
        # where it is under 0.6, that row's goal is beyond any copy on this host.
        "streaming_memcpy_16MiB_vs_memcpy": _ratio(report["memcpy_streaming"]["16MiB"], memcpy["16MiB"], None),
        "shm_16MiB_vs_one_copy_sender": _ratio(shm.get("16MiB", {}), report["one_copy_sender"]["16MiB"], None),
        "shm_16MiB_vs_one_copy_serial": _ratio(shm.get("16MiB", {}), report["one_copy_serial"]["16MiB"], None),
        "tcp_16MiB_vs_mooncake_tcp": _ratio(tcp.get("16MiB", {}), report["mooncake"].get("16MiB", {}), None),
        # What UCX itself moves here: how much of the ucx rows' gap to tcp is UCX's (its ceiling
        # over the socket's), what posting receives one at a time would cost (the backend's
        # receiver posts them ahead, as it admits headers) and how much the rest of the backend.
        "ucx_16MiB_vs_ucx_ceiling": _ratio(ucx.get("16MiB", {}), ucx_ceiling.get("16MiB", {}), None),
        "ucx_16MiB_vs_ucx_one_at_a_time": _ratio(ucx.get("16MiB", {}), ucx_one.get("16MiB", {}), None),
        "ucx_one_at_a_time_16MiB_vs_ucx_ceiling": _ratio(ucx_one.get("16MiB", {}), ucx_ceiling.get("16MiB", {}),
                                                         None),
        "ucx_ceiling_16MiB_vs_socket_ceiling": _ratio(ucx_ceiling.get("16MiB", {}), ceiling.get("16MiB", {}), None),
        # The ucx goal rows per CPU second of both ends instead of per wall second: on two shared
        # cores, what a byte costs in CPU bounds the rate (UCX's tcp transport receives through
        # its own buffers; the tcp backend straight into the pages).
        "ucx_16MiB_vs_tcp_16MiB_per_cpu_s": _ratio_per_cpu_s(ucx.get("16MiB", {}), tcp.get("16MiB", {})),
        "ucx_64KiB_vs_tcp_64KiB_per_cpu_s": _ratio_per_cpu_s(ucx.get("64KiB", {}), tcp.get("64KiB", {})),
    }
    for name in backends:
        scheme, flags = variant(name)
        if flags and not flags & {"ring", "resident"}:  # a variant against its plain backend: shm-crc32c / shm
            for size in ("64KiB", "16MiB"):
                rows[f"{name}_{size}_vs_{scheme}_{size}"] = _ratio(
                    backends[name].get(size, {}), backends.get(scheme, {}).get(size, {}), None
                )
    rows["shm-crc32c_16MiB_vs_memcpy"] = _ratio(backends.get("shm-crc32c", {}).get("16MiB", {}), memcpy["16MiB"], None)
    return rows


def one_round(args: argparse.Namespace, backends: list[str]) -> dict:
    """Every backend, the ceilings and the in-process baselines once (the baselines before
    and after the backends, so drifting load hits both sides)."""
    total_bytes = args.mib_per_repeat << 20
    before = memcpy_baselines(SIZES_BYTES, total_bytes, (args.repeats + 1) // 2)
    report: dict = {"backends": {}, "loadavg_1m": round(os.getloadavg()[0], 2)}
    for backend in backends:
        report["backends"][backend] = bench_backend(backend, args.repeats, total_bytes)
    if args.resident:  # one 16 MiB frame per sample into a 16 MiB pool: source and pages stay in cache
        report["backends"]["shm-resident"] = bench_backend("shm", args.repeats, 16 << 20, {"16MiB": 16 << 20},
                                                           warmups=(16 << 20,) * RESIDENT_WARMUPS)
    report["mooncake"] = bench_mooncake(args.repeats, total_bytes)
    report["socket_ceiling"] = bench_socket(args.repeats, total_bytes)
    if "ucx" in backends:
        report["ucx_ceiling"], report["ucx_one_at_a_time"] = bench_ucx_ceiling(
            args.repeats, total_bytes, bench_config("ucx").max_inflight_bytes)
    else:
        report["ucx_ceiling"] = report["ucx_one_at_a_time"] = {"skipped": "the ucx backend is not measured"}
    after = memcpy_baselines(SIZES_BYTES, total_bytes, (args.repeats + 1) // 2)
    for baseline, by_size in before.items():
        report[baseline] = {name: summarize(gbps + after[baseline][name]) for name, gbps in by_size.items()}
    memcpy = report["memcpy_numpy_copyto"]
    for name in report["backends"]:
        with_ratios(report["backends"][name], memcpy)
    with_ratios(report["mooncake"], memcpy)
    report["goals"] = goals(report)
    return report


def over_rounds(rows: list[dict]) -> dict:
    """One goal row from every round's: the median ratio, its extremes, met on the median."""
    ratios = [row["ratio"] for row in rows if "ratio" in row]
    if not ratios:
        return rows[0]
    out = {"ratio": round(statistics.median(ratios), 3), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "per_round": ratios}
    goal = rows[0].get("goal")
    return out if goal is None else {**out, "goal": goal, "met": out["ratio"] >= goal}


def run(args: argparse.Namespace) -> dict:
    from kvstore.transfer import ucx_unavailable_reason
    from kvstore.transfer.frames import default_checksum_algo

    loadavg_before = os.getloadavg()
    skipped, backends = {}, []
    for backend in args.backends.split(","):
        reason = ucx_unavailable_reason() if variant(backend)[0] == "ucx" else None
        if reason is None:
            backends.append(backend)
        else:
            skipped[backend] = {"skipped": reason}
    rounds = []
    for r in range(args.rounds):  # the order rotates, so no backend always runs first or last
        shift = r % max(1, len(backends))
        rounds.append(one_round(args, backends[shift:] + backends[:shift]))
    report = {
        "bytes_per_sample": args.mib_per_repeat << 20,
        "checksum": default_checksum_algo().name.lower(),
        "rounds": len(rounds),
        "goals": {name: over_rounds([r["goals"][name] for r in rounds]) for name in rounds[0]["goals"]},
        "last_round": {**rounds[-1], "backends": {**rounds[-1]["backends"], **skipped}},
        "loadavg_1m_per_round": [r["loadavg_1m"] for r in rounds],
        "loadavg": {"before": _rounded(loadavg_before), "after": _rounded(os.getloadavg())},
    }
    report["medians_gbps"] = medians_over_rounds(rounds)
    return report


def medians_over_rounds(rounds: list[dict]) -> dict:
    """Each backend's and baseline's median GB/s per size, the median over rounds."""
    out: dict = {}
    for section in ("backends",):
        for name in rounds[0][section]:
            for size, row in rounds[0][section][name].items():
                if isinstance(row, dict) and "median_gbps" in row:
                    values = [r[section][name][size]["median_gbps"] for r in rounds]
                    out.setdefault(name, {})[size] = round(statistics.median(values), 3)
    for name in ("memcpy_numpy_copyto", "memcpy_streaming", "one_copy_sender", "one_copy_serial",
                 "one_copy_sender_crc32c", "one_copy_serial_crc32c", "socket_ceiling", "ucx_ceiling",
                 "ucx_one_at_a_time", "mooncake"):
        for size, row in rounds[0][name].items():
            if isinstance(row, dict) and "median_gbps" in row:
                values = [r[name][size]["median_gbps"] for r in rounds]
                out.setdefault(name, {})[size] = round(statistics.median(values), 3)
    return out


def _rounded(values: tuple[float, ...]) -> list[float]:
    return [round(v, 2) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="every backend and baseline, this many times")
    parser.add_argument("--resident", action=argparse.BooleanOptionalAction, default=True,
                        help="also shm with one 16 MiB frame per sample into a 16 MiB pool (cache-resident)")
    parser.add_argument("--mib-per-repeat", type=int, default=64)
    parser.add_argument("--backends", default="shm,shm-crc32c,shm-ring,tcp,ucx")
    parser.add_argument("--child-receive", nargs=3, metavar=("BACKEND", "BYTES", "PLAN"), help=argparse.SUPPRESS)
    parser.add_argument("--child-mooncake", nargs=2, metavar=("ROLE", "ARG"), help=argparse.SUPPRESS)
    parser.add_argument("--child-socket", nargs=2, metavar=("BYTES", "SAMPLES"), help=argparse.SUPPRESS)
    parser.add_argument("--child-ucx-ceiling", nargs=2, metavar=("ROLE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_receive:
        child_receive(args.child_receive[0], int(args.child_receive[1]), json.loads(args.child_receive[2]))
    elif args.child_mooncake:
        child_mooncake(*args.child_mooncake)
    elif args.child_socket:
        socket_receiver(int(args.child_socket[0]), int(args.child_socket[1]))
    elif args.child_ucx_ceiling:
        ucx_ceiling_child(args.child_ucx_ceiling[0], json.loads(args.child_ucx_ceiling[1]))
    else:
        started = time.perf_counter()
        report = run(args)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
