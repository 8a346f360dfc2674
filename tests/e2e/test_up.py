"""`tidekv up` as a user runs it: the first start calibrates the cost models into its data
directory and says so, the cluster serves gRPC and the OpenAI HTTP API, a Prometheus scrape
config lists every process's /metrics, `tidekv up` and `tidekv status` name every address
(role, worker id, gRPC, transfer, metrics, HTTP) and each answers, `tidekv top` finds the
Conductor by itself, and Ctrl-C stops everything, keeping the logs."""

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
ADDRESS_COLUMNS = ["ROLE", "WORKER", "GRPC", "TRANSFER", "METRICS", "HTTP"]


def address_table(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """The rows of the address table in ``text``, by (role, worker id)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ADDRESS_COLUMNS) + 1
    rows = {}
    for line in lines[start:]:
        cells = line.split()
        if len(cells) != len(ADDRESS_COLUMNS):
            break
        rows[cells[0], cells[1]] = dict(zip(ADDRESS_COLUMNS, cells, strict=True))
    return rows


def tidekv(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def check_addresses(rows: dict, endpoint: str, http: str, live: bool = True) -> None:
    """Every process is named, with the addresses it serves; while it runs, each /metrics answers."""
    from observe.top import scrape

    assert set(rows) == {("conductor", "-"), ("prefill", "prefill-0"), ("decode", "decode-0"), ("http", "-")}, rows
    assert rows["conductor", "-"]["GRPC"] == endpoint and rows["http", "-"]["HTTP"] == http
    for key in (("prefill", "prefill-0"), ("decode", "decode-0")):
        assert rows[key]["GRPC"].startswith("127.0.0.1:") and rows[key]["TRANSFER"].startswith(("tcp://", "shm://"))
    for key in (("conductor", "-"), ("prefill", "prefill-0"), ("decode", "decode-0")):
        assert rows[key]["METRICS"].startswith("127.0.0.1:")
        assert not live or any(name.startswith("tidekv:") for name, _, _ in scrape(rows[key]["METRICS"])), key


def test_up_calibrates_serves_grpc_and_http_and_stops(tmp_path, reference):
    data = tmp_path / "data"
    prom = tmp_path / "prometheus.yml"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "up", "--data-dir", str(data), "--port", "0",
                             "--http-port", "0", "--prometheus", str(prom)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status: dict = {}
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
        status = address_table(tidekv("status", "--data-dir", str(data)))
        check_addresses(status, endpoint, http)
        assert sorted(targets) == sorted(r["METRICS"] for r in status.values() if r["METRICS"] != "-")
        top = tidekv("top", "--data-dir", str(data), "--iterations", "1")
        assert f"tidekv top - {status['conductor', '-']['METRICS']}" in top and "prefill 1  decode 1" in top
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    assert "calibration saved to" in err and str(data / "calibration") in err
    printed = address_table(err)  # as `tidekv up` printed them when it was ready
    check_addresses(printed, endpoint, http, live=False)
    assert printed == status
    assert {p.name for p in (data / "logs").iterdir()} >= {"conductor.log", "prefill-0.log", "decode-0.log", "http.log"}
