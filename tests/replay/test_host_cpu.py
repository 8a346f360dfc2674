"""bench.host_cpu: the busy and steal shares between two samples of /proc/stat's counters."""

from __future__ import annotations

import sys
import time

import pytest

from bench.host_cpu import HostCPU, read_counters, shares


def test_shares_take_the_samples_around_the_span() -> None:
    samples = [(0.001, 10, 0, 100), (0.5, 30, 5, 200), (1.0, 80, 5, 300)]
    assert shares(samples, 0.0, 0.5) == {"from_s": 0.0, "to_s": 0.5, "busy_share": 0.2, "steal_share": 0.05}
    # 0.2..0.9 lies between the first and the last sample: both are taken
    assert shares(samples, 0.2, 0.9) == {"from_s": 0.0, "to_s": 1.0, "busy_share": 0.35, "steal_share": 0.025}
    assert shares(samples[:1], 0.0, 1.0) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_sampler_reads_growing_counters() -> None:
    busy, steal, total = read_counters()
    assert 0 <= steal <= total and 0 < busy <= total
    with HostCPU(interval_s=0.05) as cpu:
        time.sleep(0.3)
    assert len(cpu.samples) >= 3
    assert all(b[0] > a[0] and b[3] >= a[3] for a, b in zip(cpu.samples, cpu.samples[1:], strict=False))
    got = shares(cpu.samples, 0.0, cpu.samples[-1][0])
    assert 0 <= got["busy_share"] <= 1 and 0 <= got["steal_share"] <= 1
