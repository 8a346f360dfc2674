"""`tidekv replay` driving the OpenAI HTTP front instead of gRPC: the same window, every
request accounted for, the same report schema."""

from __future__ import annotations

from deploy.local import ClusterConfig, LocalCluster
from replay.cli import main
from replay.report import load_report
from tests.replay.conftest import DECODE_ARGS, WORKER_ARGS
from tests.replay.test_live_cluster import REPLAY_ARGS, WINDOW


def test_replay_over_the_http_front_accounts_for_every_request(tmp_path):
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS, decode_args=DECODE_ARGS,
                           http_port=0)
    with LocalCluster(config) as cluster:
        assert cluster.http_url.startswith("http://127.0.0.1:")
        out = tmp_path / "http"
        assert main(["replay", "--trace", str(WINDOW), "--endpoint", cluster.http_url, *REPLAY_ARGS,
                     "--out", str(out), "--no-plots"]) == 0
    report = load_report(out)
    s = report.summary
    assert s.counts.total == 16 and sorted(r.index for r in report.records) == list(range(16))
    assert s.counts.finished == 16, [(r.request_id, r.outcome, r.status, r.error) for r in report.records]
    for r in report.records:
        assert r.num_output_tokens == r.max_tokens and r.prompt_tokens == r.prompt_len
        assert r.ttft_s == r.token_times_s[0]
    assert s.cache.cached_tokens > 0
    assert s.run["endpoint"] == cluster.http_url
