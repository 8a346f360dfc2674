"""The soak's CI variant (``bench/soak.py``, 30 minutes by default): 30 s of trace replay on a
1 prefill + 1 decode cluster, in windows of 20 requests, sampled every 2 s. Once the load has drained, no worker holds a
page or a request (reservations included) and the Conductor holds no admission slot; no
process died. The RSS slope of each process is printed for whoever reads ``-s`` output (the
prefix caches fill during a short run, so it is no leak signal at this length)."""

import json

from bench.soak import SoakConfig, run_soak

DURATION_S = 30.0


def test_soak_leaves_nothing_held_and_no_process_died():
    report = run_soak(SoakConfig(duration_s=DURATION_S, sample_every_s=2.0, window_requests=20))
    slopes = {name: (p["rss_slope_mb_per_min"], p["rss_mb"]["first"], p["rss_mb"]["last"], p["num_fds"]["last"],
                     p["num_threads"]["last"]) for name, p in report["processes"].items()}
    print("\nsoak:", json.dumps({"requests": report["requests"], "load_s": report["load_s"],
                                 "rss_slope_mb_per_min, rss first, rss last, fds, threads": slopes,
                                 "leaks_at_end": report["leaks_at_end"]}, indent=1))

    requests = report["requests"]
    assert requests["num_windows"] >= 2 and requests["num_requests"] > 0
    assert requests["outcomes"] == {"finished": requests["num_requests"]}, requests["not_finished_examples"]
    leaks = report["leaks_at_end"]
    assert leaks["num_workers_answering"] == 2, leaks
    for wid, held in leaks["workers"].items():
        assert held == {"pages_not_free": 0, "live_requests": 0}, (wid, held)
    assert leaks["conductor"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0}, leaks
    assert leaks["none_leaked"]
    assert report["process_exits"] == [] and report["none_died"], report["process_exits"]
    assert set(report["processes"]) == {"conductor", "prefill-0", "decode-0"}
    assert all(p["rss_mb"]["n"] >= 10 for p in report["processes"].values())  # sampled throughout
