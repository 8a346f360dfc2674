"""The simulator and the ``tidekv`` command line load without torch, gRPC or matplotlib: the
simulator models the engine and the wire, so its start costs what its own modules cost
(torch alone took about 2 s to import). Checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "grpc", "matplotlib")


def test_simulator_and_cli_parser_import_no_torch_grpc_or_matplotlib() -> None:
    code = ("import sys\n"
            "import replay.sim, replay.sim.run, replay.sim.cli, replay.sim.fit, replay.sim.sweep\n"
            "from deploy.cli import build_parser\n"
            "build_parser()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_engine_names_load_on_first_use() -> None:
    code = ("import sys\n"
            "import engine\n"
            "assert engine.DEFAULT_BLOCK_SIZE == 32 and engine.SamplingParams().max_new_tokens == 16\n"
            "assert 'torch' not in sys.modules\n"
            "assert engine.load_model and engine.BUILTIN_MODELS == ('tiny', 'tiny-k2')\n"
            "assert 'torch' in sys.modules and set(engine.__all__) <= set(dir(engine))\n")
    subprocess.run([sys.executable, "-c", code], check=True)
