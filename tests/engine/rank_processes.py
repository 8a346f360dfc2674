"""Every rank of a test's group as its own process: started together, waited for with a bound,
and killed if still running when the test gives up on them."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_rank_processes(cmd: list[str], world: int, timeout_s: float) -> list[tuple[int, str]]:
    """``cmd --rank R`` for R in 0..world-1, run from the checkout; (exit code, output) of each."""
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, text) for p, text in zip(procs, outputs, strict=True)]
