"""``tidekv simulate``: one simulated run with a report, or a sweep over cluster shapes and
policies that prints the cheapest configuration meeting the SLOs at the trace's rate.

``add_simulate_parser(subparsers)`` adds the subcommand (``deploy/cli.py`` wires it in); the
trace, selection and scaling flags are the live replay's (``replay.cli.add_trace_args``), so
a simulated run and a live one of the same window are made from the same transform. A run
streams its records into the report directory as they are made (``ReportWriter``), so its
memory does not grow with the trace (``--tile N``: N back-to-back copies of the selection);
only the plots read them all back. A sweep's shapes run ``--jobs`` at a time, each in a
process of its own (``replay.sim.sweep``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conductor.config import ADMISSION_MODES, ConductorConfig
from costmodel import CostModels, load_models
from costmodel.overheads import ClusterOverheads
from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from replay.cli import add_trace_args, summary_text, transform_from_args
from replay.sim.run import SimConfig, SimResult, simulate
from replay.sim.sweep import SWEEP_KEYS, default_jobs, parse_sweep, print_rows, run_sweep


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="simulate a trace on a modelled cluster (same Conductor core)")
    add_trace_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--policy", default="mooncake")
    p.add_argument("--admission-mode", default="predictive", choices=ADMISSION_MODES)
    p.add_argument("--no-pull", action="store_true", help="local reuse only (no pulls between prefill workers)")
    p.add_argument("--calibration", default="", help="cost models from `tidekv calibrate` "
                                                     "(default: the built-in estimate for tiny on CPU)")
    p.add_argument("--overheads", default="", help="what the live cluster adds to the calibrated engine "
                                                   "(`python -m replay.sim.fit` on a live replay; default none)")
    p.add_argument("--device-bytes", type=int, default=PrefillConfig.device_bytes,
                   help="device tier (the engine's page pool) per prefill worker; 0: none")
    p.add_argument("--dram-bytes", type=int, default=PrefillConfig.dram_bytes, help="DRAM tier per prefill worker")
    p.add_argument("--ssd-bytes", type=int, default=PrefillConfig.ssd_bytes, help="SSD tier per prefill worker")
    p.add_argument("--eviction", default="lru")
    p.add_argument("--cpp-stages", type=int, default=1, help="each prefill worker a chunked-pipeline group of this "
                                                             "many stages (conductor/cpp.py models it)")
    p.add_argument("--cpp-chunk-tokens", type=int, default=PrefillConfig.cpp_chunk_tokens)
    p.add_argument("--snapshot-interval-blocks", type=int, default=PrefillConfig.snapshot_interval_blocks)
    p.add_argument("--decode-pages", type=int, default=DecodeConfig.num_pages, help="pages per decode worker")
    p.add_argument("--decode-slots", type=int, default=DecodeConfig.num_slots)
    p.add_argument("--max-batch", type=int, default=DecodeConfig.max_batch)
    p.add_argument("--max-running", type=int, default=ConductorConfig.max_running)
    p.add_argument("--max-queued", type=int, default=ConductorConfig.max_queued)
    p.add_argument("--sweep", nargs="*", default=None, metavar="KEY=V1,V2",
                   help=f"simulate every combination of {', '.join(SWEEP_KEYS)} and print the cheapest that "
                        "meets the SLOs")
    p.add_argument("--min-attainment", type=float, default=0.9, help="sweep: SLO attainment a config must reach")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="sweep: shapes simulated at once, each in a process of its own (default: the CPUs this "
                        "process may use; 1: one after another in this process)")
    p.add_argument("--tile", type=int, default=1, metavar="N",
                   help="simulate N back-to-back copies of the selection, each with its own hash ids "
                        "(replay.transform.TiledTrace; made as they are read)")
    p.add_argument("--out", default="", help="report directory (default simulate-<date>-<time>)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=run_simulate)
    return p


def _costs(args: argparse.Namespace) -> CostModels:
    if args.calibration:
        return load_models(args.calibration)
    from costmodel.builtin import tiny_cpu_estimate

    print("simulate: no --calibration: using the built-in estimate for the tiny model on CPU", file=sys.stderr)
    return tiny_cpu_estimate()


def sim_config(args: argparse.Namespace | dict, **override) -> SimConfig:
    """The run's configuration from the flags (``args``, or their ``vars``), with ``override``
    (a sweep's shape) applied. The SLOs are the requests' (the transform's --ttft-slo-s, --tbt-slo-s)."""
    v = {**(args if isinstance(args, dict) else vars(args)), **override}
    conductor = ConductorConfig(policy=v["policy"], admission_mode=v["admission_mode"],
                                pull_from_peers=not v["no_pull"], max_running=v["max_running"],
                                max_queued=v["max_queued"])
    prefill = PrefillConfig(device_bytes=v["device_bytes"], dram_bytes=v["dram_bytes"], ssd_bytes=v["ssd_bytes"],
                            eviction=v["eviction"], snapshot_interval_blocks=v["snapshot_interval_blocks"],
                            cpp_stages=int(v["cpp_stages"]), cpp_chunk_tokens=int(v["cpp_chunk_tokens"]))
    decode = DecodeConfig(num_pages=v["decode_pages"], num_slots=v["decode_slots"], max_batch=v["max_batch"])
    overheads = ClusterOverheads.load(v["overheads"]) if v.get("overheads") else ClusterOverheads()
    return SimConfig(int(v["prefill"]), int(v["decode"]), conductor, prefill, decode, overheads=overheads)


def _write_run(out: Path, scaled, config: SimConfig, costs: CostModels, plots: bool) -> SimResult:
    """Simulates into the report directory ``out``: streamed when the requests' indexes rise
    in arrival order (a sorted trace: the usual case), else kept and written at the end; a
    status line on stderr meanwhile (``replay.progress.SimProgress``)."""
    from replay.progress import SimProgress
    from replay.report import REQUESTS_FILE, ReportWriter, write_report
    from replay.sim.sinks import KeptRecords

    requests = scaled.requests
    if isinstance(requests, tuple) and any(a.index >= b.index for a, b in zip(requests, requests[1:], strict=False)):
        kept = KeptRecords()
        result = simulate(scaled, config, costs, sink=SimProgress(kept, scaled.num_requests, sys.stderr))
        write_report(out, kept.records, result.summary, plots=plots)
        return result
    writer = ReportWriter(out)
    try:
        result = simulate(scaled, config, costs, sink=SimProgress(writer, scaled.num_requests, sys.stderr))
    finally:
        writer.close()
    if plots:
        from replay.plots import plot_report
        from replay.records import read_records

        plot_report(out, read_records(out / REQUESTS_FILE))
    return result


def run_simulate(args: argparse.Namespace) -> int:
    from replay.traces import read_trace
    from replay.transform import TiledTrace, apply_transform

    transform = transform_from_args(args)
    trace = read_trace(args.trace, args.format, block_tokens=args.trace_block_tokens)
    scaled = apply_transform(trace, transform, materialise=False)
    if args.tile != 1:
        scaled = TiledTrace(scaled, args.tile)
    costs = _costs(args)
    out = Path(args.out or time.strftime("simulate-%Y%m%d-%H%M%S"))
    if args.sweep is not None:
        flags = {k: v for k, v in vars(args).items() if k != "func"}
        rows, best = run_sweep(parse_sweep(args.sweep), scaled, costs, flags, sim_config, args.min_attainment,
                               jobs=args.jobs or default_jobs())
        print_rows(rows)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps({"rows": rows, "best": best}, indent=2) + "\n")
        if best is None:
            print(f"no configuration reaches SLO attainment {args.min_attainment}")
            return 1
        print(f"cheapest meeting the SLOs (attainment >= {args.min_attainment}): {best['prefill']} prefill + "
              f"{best['decode']} decode, policy {best['policy']} (attainment {best['attainment']:.3f})")
        return 0
    config = sim_config(args)
    print(f"simulating {scaled.num_requests} requests on {config.num_prefill} prefill + {config.num_decode} decode "
          f"({config.conductor.policy}) -> {out}", file=sys.stderr)
    result = _write_run(out, scaled, config, costs, plots=not args.no_plots)
    print(summary_text(result.summary))
    print(f"simulated in {result.stats['wall_s']:.2f}s ({result.stats['num_events']} events); report: {out}")
    return 0
