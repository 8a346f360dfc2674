"""The runnable command blocks of README.md and docs/*.md, and how the docs check runs them.

A block is runnable when the line right before its fence is a marker::

    <!-- runnable -->
    <!-- runnable: cluster="--prefill 2 --decode 1" timeout=180 expect="cached-token ratio 0\\.[1-9]" -->

Options (shell words after ``runnable:``): ``cluster="ARGS"`` starts ``tidekv up ARGS`` first
and stops it after the block; ``timeout=S`` bounds the block (default 60 s); ``expect="RE"``
is a regular expression its stdout must match (beyond exit status 0). A block without a
marker is never run, so a new block is checked only once its author marks it.

The block runs as one ``bash -euo pipefail`` script, as written, in a fresh directory that
links every top-level entry of the checkout (``data/...`` and ``.venv/bin/tidekv`` resolve;
what the block writes stays there), with a HOME of its own (``tidekv status`` and ``tidekv
top`` find the block's cluster as they would a user's). Two rewrites only, both printed with
the block when it fails: ``.venv/bin/`` is the running interpreter's bin directory, and the
cluster's fixed ports, ``127.0.0.1:50051`` (gRPC) and ``127.0.0.1:8000`` (HTTP), are the free
ports the cluster was given.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKER = re.compile(r"^\s*<!--\s*runnable(?::(?P<options>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^\s*```")
GRPC_PORT, HTTP_PORT = "127.0.0.1:50051", "127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 60.0
CLUSTER_START_S = 240.0  # the first start calibrates (quick grid) and loads the model in every process


@dataclass(frozen=True)
class Block:
    name: str  # "README.md:42": the file and the fence's line
    path: Path
    script: str
    cluster: str | None  # `tidekv up` arguments, or None: no cluster
    timeout_s: float
    expect: str | None


def parse_options(text: str, where: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(text or ""):
        key, _, value = word.partition("=")
        if key not in ("cluster", "timeout", "expect"):
            raise ValueError(f"{where}: unknown runnable option {key!r} (cluster=, timeout=, expect=)")
        out[key] = value
    return out


def find_blocks(path: Path) -> list[Block]:
    """Every marked block of one Markdown file; ValueError for a marker without a block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        where = f"{shown}:{i + 1}"
        if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
            raise ValueError(f"{where}: a runnable marker must be right above a ``` fence")
        end = next((j for j in range(i + 2, len(lines)) if FENCE.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{where}: the block has no closing fence")
        opts = parse_options(m.group("options"), where)
        out.append(Block(f"{shown}:{i + 2}", path, "\n".join(lines[i + 2:end]) + "\n", opts.get("cluster"),
                         float(opts.get("timeout", DEFAULT_TIMEOUT_S)), opts.get("expect")))
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in find_blocks(path)]


def workdir(tmp: Path) -> Path:
    """A fresh directory linking the checkout's top-level entries, and a HOME beside it."""
    work = tmp / "work"
    work.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (work / entry.name).symlink_to(entry)
    (tmp / "home").mkdir()
    return work


def environment(tmp: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEKV_") or k == "TIDEKV_TORCH_THREADS"}
    return {**env, "HOME": str(tmp / "home"), "PATH": os.pathsep.join([bin_dir, env.get("PATH", "")]),
            "PYTHONPATH": str(ROOT)}


def rewrite(script: str, ports: tuple[int, int] | None) -> str:
    script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    if ports is not None:
        script = script.replace(GRPC_PORT, f"127.0.0.1:{ports[0]}").replace(HTTP_PORT, f"127.0.0.1:{ports[1]}")
    return script


class Cluster:
    """``tidekv up ARGS`` on free ports, as a user starts it; stopped with Ctrl-C (SIGINT)."""

    def __init__(self, args: str, work: Path, env: dict[str, str]):
        from runtime.ports import free_port

        self.ports = (free_port(), free_port())
        self.log = work / "tidekv-up.log"
        cmd = [sys.executable, "-m", "deploy.cli", "up", *shlex.split(args), "--port", str(self.ports[0]),
               "--http-port", str(self.ports[1])]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self) -> None:
        until = time.monotonic() + CLUSTER_START_S
        while "tidekv cluster ready" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"tidekv up did not come up:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    script: str  # as run, after the rewrites


def run_block(block: Block, tmp: Path) -> Outcome:
    work, env = workdir(tmp), environment(tmp)
    cluster = Cluster(block.cluster, work, env) if block.cluster is not None else None
    try:
        if cluster is not None:
            cluster.wait_ready()
        script = rewrite(block.script, cluster.ports if cluster else None)
        try:
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                                  text=True, timeout=block.timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            return Outcome(124, _text(e.stdout), _text(e.stderr) + f"\n(timed out after {block.timeout_s:.0f} s)",
                           script)
        return Outcome(done.returncode, done.stdout, done.stderr, script)
    finally:
        if cluster is not None:
            cluster.stop()


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
