"""One rank of a shared-memory collectives run (``tests/engine/test_host_reduce.py`` starts
every rank as a process). Rank 0 writes what every rank saw as JSON to ``--out``.

Modes: ``check`` (sums, broadcasts and gathers of several sizes and dtypes in rounds smaller
than the tensors, ranks drifting apart by random sleeps, every result compared with the exact
answer and across ranks bit for bit); ``die`` (the last rank exits mid-run: the others'
collective must fail with GroupFailed, not hang); ``foreign`` (rank 1 cannot open the leader's
FIFOs, as on another host: every rank falls back to the backend).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.parallel import host_reduce
from engine.parallel.comm import GroupFailed

CHUNK = 4096  # bytes per round: most tensors below take several rounds


def _exact(n: int, dtype: torch.dtype, scale: int) -> torch.Tensor:
    return (torch.arange(n) % 97 * scale).to(dtype)


def _check(reducer: host_reduce.HostReducer, rank: int, world: int) -> dict:
    jitter = random.Random(rank)
    checked = 0
    for n in (1, 7, 1024, 3000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for _ in range(5):
                time.sleep(jitter.random() * 0.01)  # one rank a round or two ahead of another
                x = _exact(n, dtype, rank + 1)
                reducer.sum_(x)
                assert torch.equal(x, _exact(n, dtype, world * (world + 1) // 2)), (n, dtype, x[:5])
                y = _exact(n, dtype, rank + 1)
                reducer.broadcast_(y, 1)
                assert torch.equal(y, _exact(n, dtype, 2)), (n, dtype, y[:5])
                got = reducer.all_gather(_exact(n, dtype, rank + 1).view(1, n))
                assert got.shape == (world, 1, n)
                for r in range(world):
                    assert torch.equal(got[r, 0], _exact(n, dtype, r + 1)), (n, dtype, r)
                checked += 3
    noise = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    reducer.sum_(noise)
    everyone = [torch.empty_like(noise) for _ in range(world)]
    dist.all_gather(everyone, noise)  # gloo: every rank's sum, bit for bit
    same = all(torch.equal(everyone[0], e) for e in everyone)
    return {"checked": checked, "bitwise_equal_across_ranks": same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="check", choices=["check", "die", "foreign"])
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--init")
    p.add_argument("--shm-dir")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    host_reduce.SHM_DIRS = (args.shm_dir,)
    if args.mode == "foreign" and args.rank == 1:  # this rank's view of the leader's directory
        host_reduce._fifo = lambda directory, src, dst: os.path.join(directory, "elsewhere", f"{src}-{dst}")
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world)
    reducer = host_reduce.open_host_reducer(dist.group.WORLD, list(range(args.world)), args.rank, timeout_s=120,
                                            chunk_bytes=CHUNK)
    dist.barrier()
    result: dict = {"reducer": reducer is not None, "left_in_shm_dir": sorted(os.listdir(args.shm_dir))}
    if args.mode == "check":
        result.update(_check(reducer, args.rank, args.world))
    elif args.mode == "die":
        if args.rank == args.world - 1:
            time.sleep(0.5)  # the others are waiting for this rank's signal by now
            os._exit(3)
        t0 = time.perf_counter()
        try:
            for _ in range(1000):
                reducer.sum_(torch.ones(10))
            result["failed"] = None
        except GroupFailed as e:
            result["failed"] = str(e)
        result["failed_after_s"] = time.perf_counter() - t0
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    if args.mode != "die":
        dist.destroy_process_group()
    os._exit(0)  # a dead peer would make gloo's teardown wait


if __name__ == "__main__":
    main()
