"""``tidekv top``: a live terminal view of a cluster from its metrics.

Sources: the Conductor's ``/metrics`` (``--endpoint HOST:PORT``: requests, TTFT and ITL
histograms, cache reuse, and every worker's queue and pages from its heartbeats), optionally
the workers' own endpoints (``--workers HOST:PORT,...``: KV tiers, decode steps), or all of it
from a Prometheus (``--prometheus URL``). Without any of them, the newest ``tidekv up`` run's
(or ``--data-dir DIR``'s) Conductor and workers, found as ``tidekv status`` finds them.
Each refresh reads them once; rates and percentiles cover the interval since the previous
refresh (the first screen: everything since start).
``Screen.render`` is pure (samples in, text out); the loop redraws with ANSI codes until
Ctrl-C or ``--iterations`` screens.
"""

from __future__ import annotations

import argparse
import math
import ssl
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from observe.prometheus import PrometheusClient

Sample = tuple[str, tuple[tuple[str, str], ...], float]  # name, sorted labels, value
CLEAR = "\x1b[H\x1b[2J"


def scrape(address: str, timeout_s: float = 5.0, tls_ca: str = "") -> list[Sample]:
    """Samples of one ``/metrics`` endpoint (``host:port``; HTTPS verified against ``tls_ca``
    when given); [] when it does not answer."""
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    try:
        with urllib.request.urlopen(f"{'https' if tls_ca else 'http'}://{address}/metrics", timeout=timeout_s,
                                    context=context) as resp:
            text = resp.read().decode()
    except OSError:
        return []
    return [(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def from_prometheus(client: PrometheusClient) -> list[Sample]:
    out = []
    for s in client.query('{__name__=~"tidekv:[a-z_]+"}'):
        labels = dict(s["metric"])
        name = labels.pop("__name__")
        labels.pop("instance", None)
        labels.pop("job", None)
        out.append((name, tuple(sorted(labels.items())), float(s["value"][1])))
    return out


class Samples:
    """Lookups over one read of every source."""

    def __init__(self, samples: list[Sample]):
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for name, labels, value in samples:
            self.by_name[name].append((dict(labels), value))

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.by_name.get(name, ()) if all(labels.get(k) == m for k, m in match.items()))

    def rows(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.by_name.get(name, [])

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative (le, count) of a histogram, summed over its series."""
        acc: dict[float, float] = defaultdict(float)
        for labels, v in self.rows(name + "_bucket"):
            acc[float(labels["le"])] += v
        return sorted(acc.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """``histogram_quantile`` over cumulative buckets (linear within a bucket); NaN when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank, prev_le, prev_count = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def _delta(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    old = dict(before)
    return [(le, c - old.get(le, 0.0)) for le, c in now]


def _ms(seconds: float) -> str:
    return "    -" if math.isnan(seconds) else f"{seconds * 1000:7.1f}"


@dataclass
class Screen:
    """One screen, from this read and the previous one (None: the first screen)."""

    now: Samples
    before: Samples | None
    interval_s: float
    title: str

    def _rate(self, name: str, **match: str) -> float:
        now = self.now.total(name, **match)
        if self.before is None or self.interval_s <= 0:
            return math.nan
        return max(0.0, now - self.before.total(name, **match)) / self.interval_s

    def _latency(self, name: str) -> tuple[float, float]:
        buckets = self.now.buckets(name)
        if self.before is not None:
            recent = _delta(buckets, self.before.buckets(name))
            if recent and recent[-1][1] > 0:
                buckets = recent
        return quantile(0.5, buckets), quantile(0.99, buckets)

    def render(self) -> str:
        n = self.now
        ttft = self._latency("tidekv:time_to_first_token_seconds")
        itl = self._latency("tidekv:inter_token_latency_seconds")
        prompt, cached = n.total("tidekv:prompt_tokens_total"), n.total("tidekv:cached_prompt_tokens_total")
        alive = {labels.get("role", "?"): int(v) for labels, v in n.rows("tidekv:workers_alive")}
        lines = [
            f"tidekv top - {self.title} - {time.strftime('%H:%M:%S')}",
            f"requests  running {n.total('tidekv:num_requests_running'):.0f}  waiting "
            f"{n.total('tidekv:num_requests_waiting'):.0f}  total {n.total('tidekv:requests_total'):.0f}  "
            f"rate {self._rate('tidekv:requests_total'):.2f}/s  rejected "
            f"{n.total('tidekv:requests_total', outcome='rejected'):.0f}  failed "
            f"{n.total('tidekv:requests_total', outcome='failed'):.0f}",
            f"workers   prefill {alive.get('prefill', 0)}  decode {alive.get('decode', 0)}",
            f"latency   TTFT p50 {_ms(ttft[0])} ms  p99 {_ms(ttft[1])} ms   ITL p50 {_ms(itl[0])} ms  "
            f"p99 {_ms(itl[1])} ms",
            f"cache     hit ratio {cached / prompt if prompt else 0.0:6.1%} of {prompt:.0f} prompt tokens",
            "", f"{'WORKER':<20} {'ROLE':<8} {'QUEUED':>6} {'RUNNING':>7} {'FREE PAGES':>11} {'TOTAL':>7}",
        ]
        lines += self._workers() or ["(no workers)"]
        tiers = self._tiers()
        if tiers:
            header = f"{'WORKER':<20} {'TIER':<7} {'BLOCKS':>7} {'USED MiB':>9} {'CAP MiB':>9} {'FILL':>6}"
            lines += ["", header, *tiers]
        return "\n".join(lines) + "\n"

    def _workers(self) -> list[str]:
        table: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        for name in ("queued_requests", "running_requests", "free_pages", "total_pages"):
            for labels, v in self.now.rows(f"tidekv:worker_{name}"):
                table[(labels.get("worker_id", "?"), labels.get("role", "?"))][name] = v
        return [f"{w:<20} {r:<8} {c.get('queued_requests', 0):6.0f} {c.get('running_requests', 0):7.0f} "
                f"{c.get('free_pages', 0):11.0f} {c.get('total_pages', 0):7.0f}" for (w, r), c in sorted(table.items())]

    def _tiers(self) -> list[str]:
        table: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        for name in ("kv_blocks", "kv_used_bytes", "kv_capacity_bytes"):
            for labels, v in self.now.rows(f"tidekv:{name}"):
                table[(labels.get("worker_id", "?"), labels.get("tier", "?"))][name] = v
        out = []
        for (w, tier), c in sorted(table.items()):
            used, cap = c.get("kv_used_bytes", 0.0), c.get("kv_capacity_bytes", 0.0)
            out.append(f"{w:<20} {tier:<7} {c.get('kv_blocks', 0):7.0f} {used / 2**20:9.1f} {cap / 2**20:9.1f} "
                       f"{used / cap if cap else 0.0:6.1%}")
        return out


def read_all(args: argparse.Namespace) -> list[Sample]:
    if args.prometheus:
        return from_prometheus(PrometheusClient(args.prometheus))
    out = []
    for address in [args.endpoint, *(a for a in args.workers.split(",") if a)]:
        out += scrape(address)
    return out


def run_top(args: argparse.Namespace) -> int:
    if not (args.endpoint or args.prometheus):
        from deploy.status_cli import find_metrics

        args.endpoint, workers = find_metrics(data_dir=args.data_dir)
        args.workers = args.workers or ",".join(workers)
        print(f"tidekv top: the Conductor's metrics at {args.endpoint}, {len(workers)} workers'", file=sys.stderr)
    title = args.prometheus or args.endpoint
    before, last = None, time.monotonic()
    shown = 0
    try:
        while args.iterations == 0 or shown < args.iterations:
            now, t = Samples(read_all(args)), time.monotonic()
            sys.stdout.write(CLEAR + Screen(now, before, t - last, title).render())
            sys.stdout.flush()
            before, last, shown = now, t, shown + 1
            if args.iterations == 0 or shown < args.iterations:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def add_top_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``tidekv top``; the parsed namespace's ``func(args)`` runs it."""
    p = subparsers.add_parser("top", help="live terminal view of a cluster's metrics")
    p.add_argument("--endpoint", default="", help="the Conductor's metrics address HOST:PORT (default: the newest "
                                                 "`tidekv up` run's, as `tidekv status` finds it)")
    p.add_argument("--data-dir", default="", help="the --data-dir of the `tidekv up` to show (instead of the newest)")
    p.add_argument("--workers", default="", help="workers' metrics addresses, HOST:PORT,... (KV tiers)")
    p.add_argument("--prometheus", default="", help="read everything from this Prometheus URL instead")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--iterations", type=int, default=0, help="stop after N screens (0: until Ctrl-C)")
    p.set_defaults(func=run_top)
    return p


def main(argv: list[str] | None = None) -> int:
    """``main(["top", ...])``: the subcommand alone, as ``tidekv`` would parse it."""
    parser = argparse.ArgumentParser(prog="tidekv")
    add_top_parser(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(["top", *sys.argv[1:]]))
