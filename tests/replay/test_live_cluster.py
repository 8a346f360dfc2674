"""Live replay of a scaled Mooncake window against a real local cluster, through the CLI.

``data/mooncake_window.jsonl`` is lines 3907-3922 of Mooncake's FAST'25 synthetic trace
(kvcache-ai/Mooncake, Apache-2.0): 16 requests over 2 s in which five prompts repeat an
earlier one's leading hash ids. Scaled to 16-token blocks and 1/128 of the length (23-443
tokens) with 1-8 output tokens.
"""

import json
from pathlib import Path

import matplotlib.image

from replay.cli import main
from replay.plots import PLOT_FILES
from replay.report import load_report

WINDOW = Path(__file__).with_name("data") / "mooncake_window.jsonl"
REPLAY_ARGS = ["--length-scale", str(1 / 128), "--output-scale", "0.1", "--max-output-tokens", "8",
               "--max-concurrency", "4", "--ttft-slo-s", "60", "--tbt-slo-s", "30", "--timeout-s", "120"]


def test_live_replay_accounts_for_every_request(cluster_1x1, tmp_path, capsys):
    out = tmp_path / "live"
    assert main(["replay", "--trace", str(WINDOW), "--endpoint", cluster_1x1.endpoint, *REPLAY_ARGS,
                 "--out", str(out)]) == 0
    report = load_report(out)
    s = report.summary
    print(capsys.readouterr().out)  # the figures, for whoever reads -s output

    assert s.counts.total == 16 and len(report.records) == 16
    assert sorted(r.index for r in report.records) == list(range(16))  # none missing, none twice
    assert s.counts.finished + s.counts.rejected + s.counts.failed == 16 and s.counts.cancelled == 0
    # A healthy 1x1 cluster with default admission (16 running) takes this whole window.
    assert s.counts.finished == 16, [(r.request_id, r.outcome, r.status, r.error) for r in report.records]
    for r in report.records:
        if r.outcome == "finished":
            assert r.finish_reason == "length" and r.num_output_tokens == r.max_tokens
            assert r.prefill_worker == "prefill-0" and r.decode_worker == "decode-0"
            assert r.prompt_tokens == r.prompt_len and r.ttft_s == r.token_times_s[0]
            assert 0 < r.prefill_worker_s < r.ttft_s and 0 <= r.loaded_cached_tokens <= r.cached_tokens
    # t3921 repeats t3906's first block, and only starts once 12 earlier requests have ended
    # (concurrency 4), so the cluster's prefix cache holds it by then.
    assert s.cache.cached_tokens > 0 and 0 < s.cache.ratio < 1
    assert s.send_delay_s.count == 16 and s.send_delay_s.p50 >= 0
    assert s.trace["num_selected"] == 16 and s.trace["transform"]["length_scale"] == 1 / 128
    assert s.run["endpoint"] == cluster_1x1.endpoint

    for name in PLOT_FILES:
        img = matplotlib.image.imread(out / name)
        assert img.size > 0 and img.std() > 0

    assert main(["report", "compare", str(out), str(out), "--out", str(tmp_path / "cmp"), "--no-plots"]) == 0
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]
    assert rows and all(r["ratio"] == (1.0 if r["a"] else None) for r in rows)  # 0/0 has no ratio


def test_simulated_and_live_reports_share_one_schema(cluster_1x1, tmp_path):
    """The same window, replayed live and simulated (calibrated or not, the figures differ; the
    fidelity benchmark compares them): both reports load, have the same summary keys and
    request fields, and compare."""
    from deploy.cli import main as tidekv

    sim_args = [a for a in REPLAY_ARGS if a not in ("--max-concurrency", "4", "--timeout-s", "120")]
    assert tidekv(["simulate", "--trace", str(WINDOW), *sim_args, "--block-size", "16",
                   "--snapshot-interval-blocks", "2", "--out", str(tmp_path / "sim")]) == 0
    assert main(["replay", "--trace", str(WINDOW), "--endpoint", cluster_1x1.endpoint, *REPLAY_ARGS,
                 "--out", str(tmp_path / "live"), "--no-plots"]) == 0
    sim, live = load_report(tmp_path / "sim"), load_report(tmp_path / "live")
    assert sim.summary.source == "simulated" and live.summary.source == "live"

    def keys(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) and k not in ("run", "workers", "trace") else {
                prefix + k}
        return out

    assert keys(sim.summary.to_dict()) == keys(live.summary.to_dict())
    assert sim.summary.counts.total == live.summary.counts.total == 16
    assert {r.index for r in sim.records} == {r.index for r in live.records}
    for name in PLOT_FILES:
        assert (tmp_path / "sim" / name).stat().st_size > 0
    assert main(["report", "compare", str(tmp_path / "live"), str(tmp_path / "sim"), "--no-plots"]) == 0
