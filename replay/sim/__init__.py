"""The discrete-event simulator: a whole cluster on one core, driven by the live Conductor's
own code.

What is real here and what is modelled:

- real: the Conductor core (``conductor.core``: snapshot builder, pending overlay, prefix
  heat, SLO resolution), every registered policy, the ``ClusterState`` with the hybrid hit
  rule, the ``SnapshotPolicy``, each prefill worker's ``Placement`` with the real eviction
  policies over DRAM and SSD capacities in bytes (``kvstore.sized``), the reuse cap;
- modelled, by the calibrated ``CostModels``: how long a prefill takes (queued one at a time
  per worker, as the live runner does), a pull of reused blocks from their holder, and a
  decode step of a continuous batch. Decode advances in segments of whole batch steps
  between the moments the batch changes, not per token per request;
- modelled, when given: what the live cluster adds to those times
  (``costmodel.overheads.ClusterOverheads``: RPCs, the live worker's prefill time, the decode
  join, step slowdown, the decode loop's stalls for the KV push and for the work other
  requests' arrivals and prefill ends cause on the shared cores, token delivery), fitted by
  ``fit`` from a live replay's records.

``run.simulate(scaled_trace, config, costs)`` returns the same ``RequestRecord``s and
``Summary`` as the live replay (``source="simulated"``), so ``tidekv report compare`` puts a
simulated run next to a live one. Modules: ``events`` (the clock and queue), ``prefill``,
``decode`` (the modelled workers), ``cluster`` (the registry the core reads), ``keys``
(block keys from a trace's hash ids), ``run`` (requests through their lifecycle), ``fit``
(overheads from live records), ``sweep`` (shapes side by side, a process each), ``cli``.
"""
