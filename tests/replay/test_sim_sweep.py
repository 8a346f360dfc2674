"""``tidekv simulate --sweep``: shapes run in a pool of processes give the rows one process
gives, a bad value fails before any shape runs, and a shape that fails stops the pool."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from deploy.cli import main as tidekv
from replay.sim.cli import sim_config
from replay.sim.sweep import parse_sweep, run_sweep
from replay.traces import SYNTHETIC_TRACE, read_trace
from replay.transform import TraceTransform, apply_transform

SELECTION = ["--trace", str(SYNTHETIC_TRACE), "--block-size", "512", "--requests", "0:400",
             "--ttft-slo-s", "10", "--tbt-slo-s", "0.2"]


def _sweep(tmp_path, name: str, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / name
    rc = tidekv(["simulate", *SELECTION, "--sweep", "prefill=1,2", "policy=mooncake,cache_aware",
                 "--out", str(out), *extra])
    path = out / "sweep.json"
    return rc, json.loads(path.read_text()) if path.exists() else None


def _without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def test_a_pool_of_two_gives_the_rows_of_one_process_in_the_grids_order(tmp_path) -> None:
    rc1, one = _sweep(tmp_path, "one", "--jobs", "1")
    rc2, two = _sweep(tmp_path, "two", "--jobs", "2")
    assert rc1 == rc2
    assert one is not None and two is not None
    assert [(r["prefill"], r["policy"]) for r in two["rows"]] == [
        ("1", "mooncake"), ("1", "cache_aware"), ("2", "mooncake"), ("2", "cache_aware")]
    assert _without_wall(two["rows"]) == _without_wall(one["rows"])
    assert len({r["attainment"] for r in one["rows"]}) > 1  # the shapes differ: a swap would show
    assert (two["best"] is None) == (one["best"] is None)
    if one["best"] is not None:
        assert _without_wall([two["best"]]) == _without_wall([one["best"]])
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("item, says", [
    ("policy=mooncake,nope", "unknown policy 'nope'"),
    ("prefill=2,0", "prefill takes worker counts, integers >= 1"),
    ("decode=two", "decode takes worker counts"),
    ("replicas=2", "KEY one of prefill, decode, policy"),
])
def test_a_bad_value_fails_before_any_shape_runs(item: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sweep([item])


def test_the_command_names_the_bad_value_and_writes_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "bad"
    rc = tidekv(["simulate", *SELECTION, "--sweep", "policy=mooncake,nope", "--out", str(out)])
    assert rc == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert not out.exists()


def failing_config(flags: dict, **shape):
    """``sim_config``, failing for two prefill workers (in the pool's process)."""
    if shape.get("prefill") == "2":
        raise RuntimeError("shape prefill=2 failed")
    return sim_config(flags, **shape)


def test_a_shape_that_fails_fails_the_sweep_and_stops_the_pool() -> None:
    scaled = apply_transform(read_trace(SYNTHETIC_TRACE),
                             TraceTransform(block_size=512, index_end=200, ttft_slo_s=10.0), materialise=False)
    from costmodel.builtin import tiny_cpu_estimate
    from deploy.cli import build_parser

    flags = vars(build_parser().parse_args(["simulate", *SELECTION]))
    flags.pop("func")
    with pytest.raises(RuntimeError, match="shape prefill=2 failed"):
        run_sweep(parse_sweep(["prefill=1,2,3"]), scaled, tiny_cpu_estimate(), flags, failing_config, 0.9, jobs=2)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="--jobs must be >= 1"):
        run_sweep(parse_sweep(["prefill=1"]), scaled, tiny_cpu_estimate(), flags, sim_config, 0.9, jobs=0)


def plain_config(flags: dict, **shape):
    """Only the swept keys and ``flags``' policy: what a caller other than the CLI passes."""
    from conductor.config import ConductorConfig
    from replay.sim.run import SimConfig

    return SimConfig(int(shape["prefill"]), int(flags["decode"]), ConductorConfig(policy=flags["policy"]))


def test_a_caller_passes_only_the_flags_the_grid_does_not_sweep() -> None:
    from costmodel.builtin import tiny_cpu_estimate

    scaled = apply_transform(read_trace(SYNTHETIC_TRACE),
                             TraceTransform(block_size=512, index_end=100, ttft_slo_s=10.0), materialise=False)
    rows, _ = run_sweep({"prefill": ["1", "2"]}, scaled, tiny_cpu_estimate(), {"policy": "mooncake", "decode": 1},
                        plain_config, 0.9, jobs=1)
    assert [(r["prefill"], r["decode"], r["policy"]) for r in rows] == [("1", 1, "mooncake"), ("2", 1, "mooncake")]
