"""The shared-memory collectives of ranks on one host (``engine.parallel.host_reduce``), with
every rank a real process: exact sums, broadcasts and gathers over several rounds while ranks
drift apart; the same bits on every rank; nothing left in the shared-memory directory once the
group is set up; a rank that dies makes the others' collective fail at once; a rank that cannot
reach the leader's directory makes every rank fall back to the backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.engine.rank_processes import run_rank_processes


def run_ranks(tmp: Path, mode: str, world: int = 3, timeout_s: float = 120) -> tuple[dict, list[int]]:
    shm = tmp / "shm"
    shm.mkdir()
    cmd = [sys.executable, "-m", "tests.engine.host_reduce_harness", "--mode", mode, "--world", str(world),
           "--init", f"file://{tmp / 'rendezvous'}", "--shm-dir", str(shm), "--out", str(tmp / "out.json")]
    ranks = run_rank_processes(cmd, world, timeout_s)
    codes = [code for code, _ in ranks]
    assert (tmp / "out.json").exists(), "\n".join(text[-2000:] for _, text in ranks)
    return json.loads((tmp / "out.json").read_text()), codes


@pytest.mark.timeout(180)
def test_sums_broadcasts_and_gathers_are_exact_on_every_rank(tmp_path):
    result, codes = run_ranks(tmp_path, "check")
    assert codes == [0, 0, 0]
    assert result["reducer"]
    assert result["checked"] == 4 * 3 * 5 * 3
    assert result["bitwise_equal_across_ranks"]
    assert result["left_in_shm_dir"] == []  # removed once every rank had it open


@pytest.mark.timeout(180)
def test_a_rank_that_dies_fails_the_others_collective(tmp_path):
    result, codes = run_ranks(tmp_path, "die")
    assert codes[-1] == 3
    assert result["failed"] is not None and "gone" in result["failed"], result
    assert result["failed_after_s"] < 60  # well inside the 120 s timeout: it noticed the death itself


@pytest.mark.timeout(180)
def test_a_rank_that_cannot_reach_the_directory_makes_every_rank_fall_back(tmp_path):
    result, codes = run_ranks(tmp_path, "foreign")
    assert codes == [0, 0, 0]
    assert result["reducer"] is False
    assert result["left_in_shm_dir"] == []


def test_closing_with_a_view_still_alive_leaves_the_mapping_to_the_view():
    import mmap

    import torch

    from engine.parallel.host_reduce import HostReducer

    reducer = HostReducer(mmap.mmap(-1, 2 * 2 * 4096), 2, 0, [], [], 4096, timeout_s=1.0)
    view = reducer._slots[0][1][:8].view(torch.float32)  # a slot a caller still reads
    reducer.close()
    assert view.tolist() == [0.0, 0.0]  # still mapped: reading it does not fault
