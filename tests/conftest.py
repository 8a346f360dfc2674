"""Test-wide settings: deterministic, small thread counts (CI machines have 2 cores)."""

import os

import torch

from proto.build import build

build()  # generated gRPC modules are build outputs: make them if missing or stale

os.environ.setdefault("TIDEKV_TORCH_THREADS", "1")
torch.set_num_threads(int(os.environ["TIDEKV_TORCH_THREADS"]))
torch.set_flush_denormal(True)

# redis_server / redis_server_factory / redis_url fixtures for every test package.
pytest_plugins = ["tests.redis_fixtures"]
