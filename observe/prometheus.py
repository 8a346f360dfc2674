"""Prometheus for Tidekv: scrape configs for a cluster's ``/metrics`` addresses, a small HTTP
API client, and a local ``prometheus`` process (the Debian package's binary) for tests and
``tidekv up --prometheus``.

``scrape_config(addresses)`` returns prometheus.yml text (one job ``tidekv`` with the given
``host:port`` targets, the recording rules of ``deploy/prometheus/rules.yml``);
``write_scrape_config`` writes it. Targets carry no extra labels: every Tidekv series already
names its ``worker_id`` and ``role``, and a target label of the same name would rename ours.
``PrometheusClient`` speaks ``/api/v1`` with urllib (no dependency). ``LocalPrometheus``
runs ``prometheus`` bound to 127.0.0.1 with its own temporary storage and stops it (SIGTERM,
then SIGKILL) on ``stop``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.logs import private_log
from runtime.ports import free_port

RULES_PATH = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules.yml"
JOB = "tidekv"


def _yaml_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def scrape_config(addresses: Sequence[str], interval_s: float = 5.0, rule_files: Sequence[str | Path] = (RULES_PATH,),
                  evaluation_interval_s: float | None = None, tls_ca: str = "") -> str:
    """prometheus.yml text scraping ``addresses`` (``host:port`` of /metrics endpoints; over
    HTTPS verified against ``tls_ca`` when given: a cluster started with TLS)."""
    if not addresses:
        raise ValueError("scrape_config needs at least one metrics address")
    bad = [a for a in addresses if "://" in a or ":" not in a]
    if bad:
        raise ValueError(f"metrics addresses must be host:port, got {bad}")
    interval = f"{interval_s:g}s"
    lines = ["# Written by observe.prometheus.scrape_config for a Tidekv cluster.", "global:",
             f"  scrape_interval: {interval}", f"  scrape_timeout: {min(interval_s, 10.0):g}s",
             f"  evaluation_interval: {evaluation_interval_s or interval_s:g}s"]
    if rule_files:
        lines += ["rule_files:", *(f"  - {_yaml_str(str(p))}" for p in rule_files)]
    lines += ["scrape_configs:", f"  - job_name: {JOB}", "    metrics_path: /metrics"]
    if tls_ca:
        lines += ["    scheme: https", "    tls_config:", f"      ca_file: {_yaml_str(str(tls_ca))}"]
    lines += ["    static_configs:",
              "      - targets:", *(f"          - {_yaml_str(a)}" for a in addresses)]
    return "\n".join(lines) + "\n"


def write_scrape_config(path: str | Path, addresses: Sequence[str], interval_s: float = 5.0,
                        rule_files: Sequence[str | Path] = (RULES_PATH,), tls_ca: str = "") -> Path:
    """Write ``scrape_config(addresses, ...)`` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scrape_config(addresses, interval_s, rule_files, tls_ca=tls_ca))
    return path


class PrometheusError(RuntimeError):
    pass


class PrometheusClient:
    """The few ``/api/v1`` calls Tidekv needs. Raises PrometheusError with the API's message."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise PrometheusError(f"{path} {params}: {body.get('error', e)}") from e
        except OSError as e:
            raise PrometheusError(f"{self.url}{path}: {e}") from e
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at_s: float | None = None) -> list[dict[str, Any]]:
        """Instant vector (or scalar as one sample): ``[{"metric": {...}, "value": [t, "v"]}]``."""
        data = self._get("/api/v1/query", query=expr, time=at_s)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[dict[str, Any]]:
        """``[{"metric": {...}, "values": [[t, "v"], ...]}]``."""
        return self._get("/api/v1/query_range", query=expr, start=start_s, end=end_s, step=step_s)["result"]

    def metric_names(self) -> set[str]:
        return set(self._get("/api/v1/label/__name__/values"))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False


class LocalPrometheus:
    """A ``prometheus`` process on 127.0.0.1 with temporary storage; use as a context manager."""

    def __init__(self, config_text: str, binary: str = "prometheus"):
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} not found (Debian: apt-get install -y prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="tidekv-prometheus-"))
        (self.dir / "prometheus.yml").write_text(config_text)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = PrometheusClient(self.url)
        self._log = private_log(self.dir / "prometheus.log", truncate=True)  # closed by stop()
        self.proc = subprocess.Popen(
            [path, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 30.0) -> LocalPrometheus:
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            if self.client.ready():
                return self
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready within {timeout_s:.0f}s: {self.log_tail()}")

    def log_tail(self) -> str:
        self._log.flush()
        return (self.dir / "prometheus.log").read_text()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalPrometheus:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
