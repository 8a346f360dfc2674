"""Trace replay: trace formats, live load replay against a cluster, reports (the simulator builds on these).

The shared vocabulary of the live replay and the discrete-event simulator:

- ``replay.traces``: ``TraceRequest``/``Trace`` and the readers/writers (Mooncake JSONL, generic JSONL/CSV);
- ``replay.tokens``: deterministic token blocks per hash id (BLAKE2b-seeded);
- ``replay.transform``: ``TraceTransform`` (selection, time/length/output scaling, SLO defaults),
  ``apply_transform`` -> ``ScaledTrace`` of ``ReplayRequest``s;
- ``replay.records``: ``RequestRecord``, one per request, ``requests.jsonl``;
- ``replay.stats``/``replay.summary``: TBT/ITL/percentiles and ``summarize`` -> ``Summary`` (``summary.json``);
- ``replay.timeline``/``replay.plots``: time series and PNG plots;
- ``replay.report``: report directories and ``report compare``;
- ``replay.live``: ``run_live_replay`` over gRPC; ``replay.cli``: the ``replay`` and ``report`` commands.
"""
