"""Command-line entries of ``replay/``: ``replay`` and ``report compare``.

``add_replay_parser(subparsers)`` and ``add_report_parser(subparsers)`` add the subcommands to
any argparse tree (``deploy/cli.py`` wires them into ``tidekv``; ``python -m replay`` uses
``build_parser`` here); each sets ``func`` to ``run_replay`` / ``run_report_compare``, which
return an exit status. Bad arguments raise ValueError with the flag and the value.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from replay.records import SCHEMA_VERSION
from replay.summary import Summary
from replay.traces import FORMATS, MOONCAKE_BLOCK_TOKENS
from replay.transform import TraceTransform


def _range(text: str, flag: str, kind: type) -> tuple:
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"{flag} must be START:END (either side may be empty), got {text!r}")
    try:
        return (kind(start) if start else None), (kind(end) if end else None)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not START:END of {kind.__name__}s") from None


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The trace, its selection, its scaling and default SLOs (``transform_from_args``), shared
    by ``replay`` and ``simulate``."""
    p.add_argument("--trace", required=True, help="trace file")
    p.add_argument("--format", default="mooncake", choices=FORMATS)
    p.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per trace hash id (512 for Mooncake traces)")
    sel = p.add_argument_group("selection")
    sel.add_argument("--window", default="",
                     help="START:END in trace seconds (either side may be empty), or N = the first N requests")
    sel.add_argument("--requests", default="", help="START:END request index range after the window")
    sel.add_argument("--sample", type=int, default=None, help="a seeded sample of N requests")
    sel.add_argument("--seed", type=int, default=0, help="seed of --sample")
    sc = p.add_argument_group("scaling")
    sc.add_argument("--rate-scale", type=float, default=1.0, help="2 = arrivals twice as fast")
    sc.add_argument("--block-size", type=int, default=16, help="the cluster's block size in tokens")
    sc.add_argument("--blocks-per-trace-block", type=int, default=1, help="cluster blocks per trace block")
    sc.add_argument("--length-scale", type=float, default=None,
                    help="prompt tokens per trace token (default: block-size*K/trace-block-tokens)")
    sc.add_argument("--output-scale", type=float, default=1.0)
    sc.add_argument("--max-prompt-tokens", type=int, default=8000)
    sc.add_argument("--max-output-tokens", type=int, default=1024)
    sc.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--ttft-slo-s", type=float, default=None, help="SLO for requests the trace gives none")
    p.add_argument("--tbt-slo-s", type=float, default=None)


def add_replay_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("replay", help="replay a trace against a live cluster and write a report")
    add_trace_args(p)
    p.add_argument("--endpoint", required=True, help="HOST:PORT of the Conductor (gRPC), or the OpenAI HTTP "
                                                     "front's base URL, http://HOST:PORT/v1")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request gRPC deadline")
    p.add_argument("--out", default="", help="report directory (default replay-<date>-<time>)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--api-key", default=os.environ.get("TIDEKV_API_KEY", ""),
                   help="API key of the cluster's public endpoint (default: $TIDEKV_API_KEY)")
    p.add_argument("--tls-ca", default="", help="PEM CA of a Conductor serving TLS")
    p.set_defaults(func=run_replay)
    return p


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="work with report directories")
    sub = p.add_subparsers(dest="report_command", required=True)
    c = sub.add_parser("compare", help="two reports side by side, with ratios B/A and overlaid CDFs")
    c.add_argument("a", help="report directory A")
    c.add_argument("b", help="report directory B")
    c.add_argument("--out", default="", help="write compare.md, compare.json and plots here")
    c.add_argument("--no-plots", action="store_true")
    c.set_defaults(func=run_report_compare)
    return p


def transform_from_args(args: argparse.Namespace) -> TraceTransform:
    window_s, first_n = (None, None), None
    if args.window and ":" not in args.window:
        if not args.window.isdigit() or int(args.window) < 1:
            raise ValueError(f"--window must be START:END seconds or a count N >= 1, got {args.window!r}")
        first_n = int(args.window)
    elif args.window:
        window_s = _range(args.window, "--window", float)
    index = _range(args.requests, "--requests", int) if args.requests else (None, first_n)
    if first_n is not None and args.requests:
        raise ValueError("give --window N (first N requests) or --requests START:END, not both")
    return TraceTransform(
        trace_block_tokens=args.trace_block_tokens, block_size=args.block_size,
        blocks_per_trace_block=args.blocks_per_trace_block, length_scale=args.length_scale,
        output_scale=args.output_scale, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens, rate_scale=args.rate_scale, window_start_s=window_s[0],
        window_end_s=window_s[1], index_start=index[0], index_end=index[1], sample_n=args.sample,
        sample_seed=args.seed, vocab_size=args.vocab_size, ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s)


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f}{unit}"


def _slo_text(s: Summary) -> str:
    if s.slo.attainment is None:
        return "no request has an SLO (--ttft-slo-s, --tbt-slo-s): no goodput or attainment"
    return (f"goodput {s.slo.goodput_rps:.3f} req/s (SLO attainment {s.slo.attainment:.3f}: {s.slo.num_met} of "
            f"{s.slo.num_with_slo} with an SLO met it)")


def summary_text(s: Summary) -> str:
    """A few lines for a terminal: counts, TTFT/TBT percentiles, goodput, cache ratio."""
    c = s.counts
    return "\n".join([
        f"requests {c.total}: finished {c.finished}, rejected {c.rejected}, failed {c.failed}, "
        f"cancelled {c.cancelled}; duration {s.duration_s:.2f}s",
        f"TTFT p50 {_fmt(s.ttft_s.p50)} p90 {_fmt(s.ttft_s.p90)} p99 {_fmt(s.ttft_s.p99)}; "
        f"TBT p50 {_fmt(s.tbt_s.p50)} p90 {_fmt(s.tbt_s.p90)}; ITL p50 {_fmt(s.itl_s.p50)}",
        f"{_slo_text(s)}; cached-token ratio {s.cache.ratio:.3f} ({s.cache.cached_tokens}/{s.cache.prompt_tokens})",
    ])


def run_replay(args: argparse.Namespace) -> int:
    from replay.live import run_live_replay  # gRPC only for this command
    from replay.traces import read_trace
    from replay.transform import apply_transform

    transform = transform_from_args(args)
    scaled = apply_transform(read_trace(args.trace, args.format, block_tokens=args.trace_block_tokens), transform)
    out = args.out or time.strftime("replay-%Y%m%d-%H%M%S")
    last = scaled.requests[-1].arrival_s
    print(f"replaying {len(scaled.requests)} of {scaled.num_in_trace} requests over {last:.1f}s "
          f"against {args.endpoint} (concurrency {args.max_concurrency}) -> {out}", file=sys.stderr)
    result = run_live_replay(scaled, args.endpoint, max_concurrency=args.max_concurrency, out_dir=out,
                             timeout_s=args.timeout_s, plots=not args.no_plots, api_key=args.api_key,
                             tls_ca=args.tls_ca)
    print(summary_text(result.summary))
    print(f"report: {out}")
    if result.summary.run.get("interrupted"):
        return 130
    if result.summary.counts.finished == 0:
        print(f"replay: no request finished; see {out}/requests.jsonl for the statuses", file=sys.stderr)
        return 1
    return 0


def run_report_compare(args: argparse.Namespace) -> int:
    from replay.report import compare_summaries, format_table, labels, load_report, write_comparison

    a, b = load_report(args.a), load_report(args.b)
    if args.out:
        table, _ = write_comparison(args.out, a, b, plots=not args.no_plots)
    else:
        table = format_table(compare_summaries(a.summary, b.summary), *labels(a, b))
    print(f"A = {a.path} ({a.summary.source}), B = {b.path} ({b.summary.source}), schema {SCHEMA_VERSION}")
    print(table, end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m replay", description="Tidekv trace replay and reports")
    sub = p.add_subparsers(dest="command", required=True)
    add_replay_parser(sub)
    add_report_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"replay: error: {e}", file=sys.stderr)
        return 2
