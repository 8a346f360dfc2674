"""The one place that reads environment variables (all prefixed ``TIDEKV_``)."""

from __future__ import annotations

import argparse
import os

import torch


def torch_threads() -> int:
    """Threads each process gives torch: TIDEKV_TORCH_THREADS, default 1 (servers share 2 cores)."""
    return int(os.environ.get("TIDEKV_TORCH_THREADS", "1"))


def worker_parser(role: str, num_pages: int) -> argparse.ArgumentParser:
    """The flags every worker shares; each role adds its own."""
    from engine import DEFAULT_BLOCK_SIZE

    p = argparse.ArgumentParser(f"tidekv serve --role {role}")
    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--conductor", required=True, help="host:port of the Conductor")
    p.add_argument("--worker-id", default="")
    p.add_argument("--num-pages", type=int, default=num_pages, help="MLA cache pages in the engine's pool")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per page and per block")
    p.add_argument("--transfer-backend", default="tcp", choices=["tcp", "shm", "ucx"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: TIDEKV_TORCH_THREADS, default 1)")
    return p


def setup_torch(threads: int | None = None) -> None:
    torch.set_num_threads(threads or torch_threads())
    torch.set_flush_denormal(True)
