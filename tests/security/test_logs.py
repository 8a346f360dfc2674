"""Refusals are logged, but a flood of them is not a flood of lines, and none goes unsaid."""

import logging

from runtime.logs import Throttled


def test_a_flood_is_logged_in_bursts_that_count_what_they_left_out(caplog):
    now = [0.0]
    log = Throttled(logging.getLogger("t"), per_s=1.0, burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t"):
        logged = [log.log(logging.INFO, "refused", "refused %d", i) for i in range(10)]
        assert logged == [True] * 3 + [False] * 7
        assert log.log(logging.INFO, "other", "another kind")  # keys are limited apart
        now[0] += 2.0
        assert log.log(logging.INFO, "refused", "refused %d", 10)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refused 1", "refused 2", "another kind", "refused 10 (7 more like it not logged)"]
