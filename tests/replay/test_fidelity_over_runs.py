"""``bench.fidelity.over_runs``: how several live runs of the same requests are judged together."""

from __future__ import annotations

from bench.fidelity import GOAL, METRICS, over_runs


def _run(live: float, error: float) -> dict:
    def validation() -> dict:
        figures = {k: {"live": live, "simulated": live * (1 + error), "relative_error": error} for k in METRICS}
        return {**figures, "within_goal": abs(error) <= GOAL}

    return {"folds": {"fit_on_first": {"validation": validation()}, "fit_on_second": {"validation": validation()}},
            "host_speed": {"mean_by_window": {"first": 1.0, "second": 1.1}}}


def test_runs_are_judged_each_and_together_with_the_live_side_s_own_scatter() -> None:
    out = over_runs([_run(0.10, 0.05), _run(0.125, -0.2), _run(0.11, 0.1)])
    fold = out["fit_on_first"]
    assert fold["runs_within_goal"] == 2 and fold["median_within_goal"]
    assert fold["ttft_p50_s"] == {"median": 0.05, "min": -0.2, "max": 0.1}
    assert out["host_speed_second_over_first"] == [1.1, 1.1, 1.1]
    first = out["live_between_runs"]["first"]["ttft_p90_s"]
    assert first == {"values": [0.1, 0.125, 0.11], "max_over_min": 1.25}
