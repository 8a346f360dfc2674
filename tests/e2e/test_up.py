"""`tidekv up` as a user runs it: the first start calibrates the cost models into its data
directory and says so, the cluster serves gRPC and the OpenAI HTTP API, a Prometheus scrape
config lists every process's /metrics, and Ctrl-C stops everything, keeping the logs."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

import engine
from conductor.client import Client

ROOT = Path(__file__).resolve().parents[2]


def test_up_calibrates_serves_grpc_and_http_and_stops(tmp_path, reference):
    data = tmp_path / "data"
    prom = tmp_path / "prometheus.yml"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--data-dir", str(data), "--port", "0",
                             "--http-port", "0", "--prometheus", str(prom)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = ""
        until = time.monotonic() + 240
        while time.monotonic() < until and "tidekv cluster ready" not in ready:
            ready = proc.stdout.readline()
            assert ready or proc.poll() is None, proc.stderr.read()
        match = re.search(r"endpoint (\S+), OpenAI HTTP API (\S+)", ready)
        assert match, ready
        endpoint, http = match.groups()
        calibrations = list((data / "calibration").glob("*.json"))
        assert len(calibrations) == 1
        out = Client(endpoint).generate(Client.request([10, 20, 30], max_tokens=5))
        assert out.token_ids == engine.generate(reference, [10, 20, 30], 5)
        with urllib.request.urlopen(f"{http}/models", timeout=10) as resp:
            assert json.load(resp)["data"][0]["id"]
        for _ in range(50):  # the scrape config is written right after the ready line
            if prom.exists():
                break
            time.sleep(0.1)
        targets = yaml.safe_load(prom.read_text())["scrape_configs"][0]["static_configs"][0]["targets"]
        assert len(targets) == 4 and http.removeprefix("http://").removesuffix("/v1") in targets  # + the front
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    assert "calibration saved to" in err and str(data / "calibration") in err
    assert {p.name for p in (data / "logs").iterdir()} >= {"conductor.log", "prefill-0.log", "decode-0.log", "http.log"}
