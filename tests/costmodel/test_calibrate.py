"""Calibration against the real engine and transfer engine, on the ``smoke`` grid: the benches
leave nothing behind, ``python -m costmodel`` writes a file ``load_models`` accepts for the
tiny model, and ``ensure_calibration`` measures once, then loads, and never replaces a corrupt
file. No test asserts a speed: only that times are positive and models monotone."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel import (
    CalibrationError,
    default_calibration_path,
    ensure_calibration,
    load_models,
)
from costmodel.cli import _grid_name, add_calibrate_parser, run_calibrate
from costmodel.grids import GRIDS
from costmodel.measure_engine import DecodeBench, PrefillBench
from costmodel.measure_transfer import TransferBench
from costmodel.progress import CalibrationProgress
from kvstore.blocks import Tier
from tests.costmodel.test_fit import assert_monotone

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.calibration


def test_prefill_bench_times_reuse_and_releases_everything(tiny):
    bench = PrefillBench(tiny, block_size=32, snapshot_interval_blocks=4, max_tokens=256)
    try:
        assert bench.time_s(40, 0) > 0
        assert bench.time_s(40, 96) > 0  # 3 reused blocks: the last carries the prefix's own snapshot
        assert not bench.cache.live
        bench.cache.check_integrity()
        stored = sum(len(bench.store.keys(t)) for t in bench.store.tiers)
        assert stored == 3, "new blocks of a timed prefill must not pile up in the bench store"
        with pytest.raises(ValueError, match="whole number"):
            bench.time_s(8, 40)
    finally:
        bench.close()


def test_decode_bench_releases_its_batch(tiny):
    bench = DecodeBench(tiny, block_size=32, max_batch=3, max_context=64, max_steps=2)
    assert bench.time_s(3, 64, 2) > 0
    assert not bench.cache.live
    bench.cache.check_integrity()


def test_transfer_bench_moves_real_blocks_and_leaves_no_pending_request(tiny):
    bench = TransferBench(tiny, block_size=32, snapshot_interval_blocks=2, block_counts=(1, 3), backends=("tcp",))
    try:
        assert bench.num_bytes(3) == 3 * 32 * 1280 + 2 * 299008  # snapshots after block 2 (interval) and 3 (last)
        for route in (Tier.DRAM, Tier.SSD, "tcp"):
            assert bench.time_s(route, 3) > 0
        assert bench.receiver.num_pending == 0
        assert not bench.puller.keys(Tier.DRAM)
    finally:
        bench.close()
    assert not bench.ssd_dir.exists()


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "TIDEKV_TORCH_THREADS": "1"}


def test_python_m_costmodel_writes_a_loadable_file(tmp_path, tiny):
    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "costmodel", "--model", "tiny", "--grid", "smoke", "--out", str(out)],
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prefill" in proc.stderr and "held-out relative error" in proc.stdout
    models = load_models(out, model_fingerprint=tiny.fingerprint, device="cpu", threads=1)
    assert models.info.grid == "smoke" and models.info.model_name == "tiny"
    assert (models.kv_bytes_per_token, models.snapshot_bytes) == (2 * 160 * 4, 4 * (4 * 64 * 64 + 3 * 768) * 4)
    assert {"tcp", "shm"} <= set(models.links) and set(models.tier_reads) == {Tier.DRAM, Tier.SSD}
    assert models.prefill_s(256, 0) > 0 and models.decode_step_s(4, 1024) > 0 and models.pull_s(64, 1) > 0
    assert_monotone(models)


def test_ensure_calibration_measures_once_then_loads(tmp_path, tiny):
    said: list[str] = []
    first = ensure_calibration(tmp_path, tiny, "cpu", 1, log=said.append, grid="smoke")
    path = default_calibration_path(tmp_path, tiny.fingerprint, "cpu", 1)
    assert path.is_file() and any(str(path) in line for line in said)
    said.clear()
    again = ensure_calibration(tmp_path, tiny, "cpu", 1, log=said.append, grid="smoke")
    assert again == first and not said


def test_ensure_calibration_refuses_to_replace_a_corrupt_file(tmp_path, tiny):
    path = default_calibration_path(tmp_path, tiny.fingerprint, "cpu", 1)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "tidekv-calibration", "vers')
    with pytest.raises(CalibrationError, match=str(path)):
        ensure_calibration(tmp_path, tiny, "cpu", 1, log=lambda _: None, grid="smoke")
    assert path.read_text() == '{"format": "tidekv-calibration", "vers'


def test_calibrate_subcommand_flags_and_defaults():
    parser = argparse.ArgumentParser(prog="tidekv")
    add_calibrate_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", "--quick"])
    assert args.func is run_calibrate
    assert (args.model, args.device, args.block_size, args.threads, args.out) == ("tiny", "cpu", 32, 0, "")
    assert _grid_name(args) == "quick"
    assert _grid_name(parser.parse_args(["calibrate"])) == "full"
    with pytest.raises(ValueError, match="--quick contradicts --grid smoke"):
        run_calibrate(parser.parse_args(["calibrate", "--quick", "--grid", "smoke"]))
    assert set(GRIDS) == {"quick", "full", "smoke"}


def test_the_quick_grid_reaches_the_prompts_the_conductor_accepts():
    # `tidekv up` calibrates on it. The prefill fit has an n*n term: extrapolated from prompts
    # 20x shorter than the longest accepted one (the old grid's 384 new tokens against 8,000),
    # it predicted a 3 s prefill at 15 s and the Conductor rejected it against a 10 s TTFT SLO.
    from conductor.config import ConductorConfig

    grid, longest = GRIDS["quick"], ConductorConfig().max_prompt_tokens
    assert max(grid.prefill_new) * 4 >= longest and grid.max_tokens * 2 >= longest
    assert grid.max_tokens < tiny_max_seq_len()


def tiny_max_seq_len() -> int:
    from engine.config import tiny_config

    return tiny_config().max_seq_len


def test_progress_writes_one_finished_line_off_a_terminal():
    stream = io.StringIO()
    with CalibrationProgress("prefill", 3, stream) as bar:
        for _ in range(3):
            bar.advance()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "prefill" in lines[0] and "3/3" in lines[0]
