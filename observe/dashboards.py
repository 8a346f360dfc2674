"""The Tidekv dashboards, as code: overview (requests, latencies, goodput, cache), KV cache
(tiers, hits, moves, transfers), scheduler (routing, prediction error, queues, prefill and
decode workers) and the HTTP front (requests by route and status, latency, bytes,
connections). ``deploy/grafana/*.json`` is their output, checked in:

    python -m observe.dashboards deploy/grafana     # rewrite the JSON after changing this file

Quantiles come from the recording rules of ``deploy/prometheus/rules.yml``
(``tidekv:<histogram>:p<q>_1m``); rates use Grafana's ``$__rate_interval``; worker-level
queries filter by the ``worker`` and ``role`` variables (``observe.grafana.WORKER_FILTER``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from observe.grafana import WORKER_FILTER as W
from observe.grafana import Dashboard, Target, bars, stat, ts

R = "[$__rate_interval]"
TOKENS_PER_S = "suffix: tok/s"  # Grafana's custom unit: the number, then " tok/s"


def rate(metric: str, by: str = "", selector: str = "") -> str:
    sel = "{" + selector + "}" if selector else ""
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{sel}{R}))"


def overview() -> Dashboard:
    finished = 'outcome=~"stop|length"'
    return Dashboard("tidekv-overview", "Tidekv / Overview", "Requests, latencies, goodput and cache reuse "
                     "as the Conductor sees them", (
        stat("Request rate", rate("tidekv:requests_total"), unit="reqps"),
        stat("TTFT p99", "max(tidekv:time_to_first_token_seconds:p99_1m)", unit="s"),
        stat("ITL p99", "max(tidekv:inter_token_latency_seconds:p99_1m)", unit="s"),
        stat("Cached-token ratio", f'{rate("tidekv:cached_prompt_tokens_total")} / '
             f'{rate("tidekv:prompt_tokens_total")}', unit="percentunit"),
        stat("Running requests", "sum(tidekv:num_requests_running)"),
        stat("Waiting requests", "sum(tidekv:num_requests_waiting)"),
        ts("Requests by outcome", Target(rate("tidekv:requests_total", "outcome"), "{{outcome}}"), unit="reqps",
           stacked=True),
        ts("Rejections and failures by reason",
           Target(rate("tidekv:requests_total", "outcome, reason", 'outcome=~"rejected|failed"'),
                  "{{outcome}}: {{reason}}"),
           Target(rate("tidekv:http_requests_total", "status", 'status=~"4..|5.."'), "HTTP front: {{status}}"),
           unit="reqps", description="the Conductor's refusals by reason; the HTTP front's own error answers by "
                                     "status (a request the front refuses never reaches the Conductor)"),
        ts("Time to first token", *(Target(f"max(tidekv:time_to_first_token_seconds:p{q}_1m)", f"p{q}")
                                    for q in (50, 90, 99)), unit="s"),
        ts("Inter-token latency", *(Target(f"max(tidekv:inter_token_latency_seconds:p{q}_1m)", f"p{q}")
                                    for q in (50, 99)), unit="s"),
        ts("End-to-end latency and queue time",
           Target("max(tidekv:e2e_request_latency_seconds:p50_1m)", "e2e p50"),
           Target("max(tidekv:e2e_request_latency_seconds:p99_1m)", "e2e p99"),
           Target("max(tidekv:request_queue_time_seconds:p99_1m)", "queue p99"), unit="s"),
        ts("Goodput (requests within their TTFT and TBT SLOs)",
           Target(rate("tidekv:requests_within_slo_total"), "within SLO"),
           Target(rate("tidekv:requests_total", selector=finished), "finished"), unit="reqps"),
        ts("Cached-token ratio by tenant",
           Target(f'{rate("tidekv:cached_prompt_tokens_total", "tenant")} / '
                  f'{rate("tidekv:prompt_tokens_total", "tenant")}', "{{tenant}}"), unit="percentunit"),
        ts("Token throughput", Target(rate("tidekv:prompt_tokens_total"), "prompt"),
           Target(rate("tidekv:cached_prompt_tokens_total"), "prompt, cached"),
           Target(rate("tidekv:generation_tokens_total"), "generated"), unit=TOKENS_PER_S),
        ts("Prompt and generation lengths (mean)",
           Target(f'{rate("tidekv:request_prompt_tokens_sum")} / {rate("tidekv:request_prompt_tokens_count")}',
                  "prompt"),
           Target(f'{rate("tidekv:request_generation_tokens_sum")} / '
                  f'{rate("tidekv:request_generation_tokens_count")}', "generated")),
        ts("Alive workers by role", Target("sum by (role) (tidekv:workers_alive)", "{{role}}")),
    ))


def kv_cache() -> Dashboard:
    return Dashboard("tidekv-kv-cache", "Tidekv / KV cache", "Blocks and bytes per tier and worker, hit ratio, "
                     "evictions and moves, transfer throughput by backend", (
        ts("Bytes per tier", Target(f"sum by (worker_id, tier) (tidekv:kv_used_bytes{{{W}}})",
                                    "{{worker_id}} {{tier}}"), unit="bytes"),
        bars("Tier fill", Target(f"sum by (tier) (tidekv:kv_used_bytes{{{W}}}) / "
                                 f"sum by (tier) (tidekv:kv_capacity_bytes{{{W}}})", "{{tier}}"), unit="percentunit"),
        ts("Blocks per tier", Target(f"sum by (worker_id, tier) (tidekv:kv_blocks{{{W}}})", "{{worker_id}} {{tier}}")),
        ts("Block hit ratio", Target(f"{rate('tidekv:kv_hits_total', 'worker_id', W)} / "
                                     f"({rate('tidekv:kv_hits_total', 'worker_id', W)} + "
                                     f"{rate('tidekv:kv_misses_total', 'worker_id', W)})", "{{worker_id}}"),
           unit="percentunit"),
        ts("Prompt tokens served from cache, by tier",
           Target(f'{rate("tidekv:cached_prompt_tokens_total", "tier")} / '
                  f'scalar({rate("tidekv:prompt_tokens_total")})', "{{tier}}"), unit="percentunit"),
        ts("Evictions, demotions and promotions",
           Target(rate("tidekv:kv_evictions_total", "tier", W), "evicted from {{tier}}"),
           Target(rate("tidekv:kv_demotions_total", "tier", W), "demoted from {{tier}}"),
           Target(rate("tidekv:kv_promotions_total", "tier", W), "promoted from {{tier}}"), unit="ops"),
        ts("Transfer throughput by backend", Target(rate("tidekv:transfer_bytes_total", "backend, direction", W),
                                                    "{{backend}} {{direction}}"), unit="Bps"),
        ts("Transfer frames by backend", Target(rate("tidekv:transfer_frames_total", "backend, direction", W),
                                                "{{backend}} {{direction}}"), unit="ops"),
        ts("Transfer time per request", *(Target(f"max by (backend) (tidekv:transfer_seconds:p{q}_1m{{{W}}})",
                                                 f"{{{{backend}}}} p{q}") for q in (50, 99)), unit="s"),
        ts("Checksum failures and aborted transfers",
           Target(f"sum by (worker_id) (increase(tidekv:transfer_checksum_failures_total{{{W}}}{R}))",
                  "checksum {{worker_id}}"),
           Target(f"sum by (worker_id) (increase(tidekv:transfer_aborted_total{{{W}}}{R}))", "aborted {{worker_id}}")),
    ))


def scheduler() -> Dashboard:
    return Dashboard("tidekv-scheduler", "Tidekv / Scheduler", "Routing branches, predicted vs observed TTFT, "
                     "queues per worker, prefill and decode engines", (
        ts("Routing decisions by branch", Target(rate("tidekv:routing_decisions_total", "policy, branch"),
                                                 "{{policy}} {{branch}}"), unit="ops", stacked=True),
        ts("Observed / predicted TTFT", *(Target(f"max(tidekv:predicted_ttft_error_ratio:p{q}_1m)", f"p{q}")
                                          for q in (10, 50, 90)),
           description="1 = the scheduler's prediction was exact; above 1 it was optimistic"),
        ts("Queued requests per worker (Conductor's view)",
           Target(f"max by (worker_id, role) (tidekv:worker_queued_requests{{{W}}})", "{{worker_id}}")),
        ts("Running requests per worker (Conductor's view)",
           Target(f"max by (worker_id, role) (tidekv:worker_running_requests{{{W}}})", "{{worker_id}}")),
        ts("Free pages per worker", Target(f"max by (worker_id) (tidekv:worker_free_pages{{{W}}}) / "
                                           f"max by (worker_id) (tidekv:worker_total_pages{{{W}}})", "{{worker_id}}"),
           unit="percentunit"),
        ts("Prefill queue",
           Target(f"sum by (worker_id) (tidekv:prefill_queued_requests{{{W}}})", "queued {{worker_id}}"),
           Target(f"sum by (worker_id) (tidekv:prefill_running_requests{{{W}}})", "running {{worker_id}}")),
        ts("Prefill throughput", Target(rate("tidekv:prefill_tokens_total", "worker_id, kind", W),
                                        "{{worker_id}} {{kind}}"), unit=TOKENS_PER_S,
           description="prompt tokens per second"),
        ts("Prefill, chunk and layer time (p99)",
           Target(f"max by (worker_id) (tidekv:prefill_seconds:p99_1m{{{W}}})", "prefill {{worker_id}}"),
           Target(f"max by (worker_id) (tidekv:prefill_chunk_seconds:p99_1m{{{W}}})", "chunk {{worker_id}}"),
           Target(f"max by (worker_id, kind) (tidekv:prefill_layer_seconds:p99_1m{{{W}}})",
                  "{{kind}} layer {{worker_id}}"), unit="s"),
        ts("Where a prefill's time goes (mean seconds per prefill)",
           Target(f"{rate('tidekv:prefill_stage_seconds_sum', 'stage', W)} / "
                  f"{rate('tidekv:prefill_stage_seconds_count', 'stage', W)}", "{{stage}}"),
           unit="s", stacked=True,
           description="queue, reuse load, compute, KV push, the decode worker's verdict, storing blocks"),
        ts("Decode batch size (mean)", Target(f"{rate('tidekv:decode_batch_size_sum', 'worker_id', W)} / "
                                              f"{rate('tidekv:decode_batch_size_count', 'worker_id', W)}",
                                              "{{worker_id}}")),
        ts("Decode step time", *(Target(f"max by (worker_id) (tidekv:decode_step_seconds:p{q}_1m{{{W}}})",
                                        f"{{{{worker_id}}}} p{q}") for q in (50, 99)), unit="s"),
        ts("Decode requests", Target(f"sum by (worker_id) (tidekv:decode_running_requests{{{W}}})",
                                     "running {{worker_id}}"),
           Target(f"sum by (worker_id) (tidekv:decode_queued_requests{{{W}}})", "queued {{worker_id}}")),
        ts("Decode pages", Target(f"sum by (worker_id) (tidekv:decode_free_pages{{{W}}})", "free {{worker_id}}"),
           Target(f"sum by (worker_id) (tidekv:decode_total_pages{{{W}}})", "total {{worker_id}}")),
        ts("Decode reservations freed without a Decode call",
           Target(rate("tidekv:decode_reservations_freed_total", "worker_id, reason", W), "{{reason}} {{worker_id}}"),
           unit="ops", description="transfer_failed: the KV transfer failed (the prefill worker ABORTs the "
                                   "placements of a Conductor that died); expired: no sign of life for the TTL"),
    ))


def http_front() -> Dashboard:
    errors = 'status=~"4..|5.."'
    return Dashboard("tidekv-http", "Tidekv / HTTP front", "The OpenAI-compatible HTTP fronts: requests by route "
                     "and status, latency, bytes, connections and what their limits refused", (
        stat("HTTP request rate", rate("tidekv:http_requests_total"), unit="reqps"),
        stat("HTTP error share", f"{rate('tidekv:http_requests_total', selector=errors)} / "
             f"{rate('tidekv:http_requests_total')}", unit="percentunit"),
        stat("Open connections", "sum(tidekv:http_open_connections)"),
        ts("HTTP requests by status", Target(rate("tidekv:http_requests_total", "status"), "{{status}}"),
           unit="reqps", stacked=True),
        ts("HTTP requests by route", Target(rate("tidekv:http_requests_total", "route"), "{{route}}"),
           unit="reqps", stacked=True),
        ts("HTTP request latency by route", *(Target(f"max by (route) (tidekv:http_request_duration_seconds:p{q}_1m)",
                                                     f"{{{{route}}}} p{q}") for q in (50, 99)), unit="s",
           description="headers received to the last response byte (a stream: its end)"),
        ts("HTTP body bytes", Target(rate("tidekv:http_request_bytes_total"), "received"),
           Target(rate("tidekv:http_response_bytes_total"), "sent"), unit="Bps"),
        ts("Connections refused by the front's limits",
           Target(rate("tidekv:http_connections_refused_total", "reason"), "{{reason}}"), unit="ops",
           description="max_connections: over the connection cap (503); header_timeout: headers too slow (408)"),
    ))


DASHBOARDS = {"overview": overview, "kv-cache": kv_cache, "scheduler": scheduler, "http": http_front}


def build_all() -> dict[str, dict[str, Any]]:
    """File stem -> dashboard JSON."""
    return {name: make().to_json() for name, make in DASHBOARDS.items()}


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def write_all(directory: str | Path) -> list[Path]:
    out = []
    for name, dashboard in build_all().items():
        path = Path(directory) / f"{name}.json"
        path.write_text(render(dashboard))
        out.append(path)
    return out


if __name__ == "__main__":
    for written in write_all(sys.argv[1] if len(sys.argv) > 1 else "deploy/grafana"):
        print(written)
