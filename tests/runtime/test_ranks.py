"""runtime.ranks.fail_fast ends its process without a closer (``os._exit``), so what the
process keeps on disk for its instance is handed to ``remove_when_failing`` and removed
before the exit: a directory it made with all it holds; a rendezvous file of another rank's
directory, then that directory once it is empty. Each case in a subprocess of its own, which
fail_fast ends with ``EXIT_RANK_LOST``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from runtime.ranks import EXIT_RANK_LOST

ROOT = Path(__file__).resolve().parents[2]


def fail_fast_after_registering(*paths: Path) -> int:
    """The exit code of a process that gives ``paths`` to ``remove_when_failing``, then fails fast."""
    code = ("import sys\nfrom runtime.ranks import fail_fast, remove_when_failing\n"
            "for path in sys.argv[1:]:\n    remove_when_failing(path)\nfail_fast('a test', None)\n")
    return subprocess.run([sys.executable, "-c", code, *map(str, paths)], cwd=ROOT, capture_output=True,
                          timeout=60).returncode


def test_a_directory_it_made_is_removed_with_all_it_holds(tmp_path):
    ssd = tmp_path / "tidekv-prefill-x" / "ssd"
    ssd.mkdir(parents=True)
    (ssd / "0.blk").write_bytes(b"kv")
    assert fail_fast_after_registering(tmp_path / "tidekv-prefill-x") == EXIT_RANK_LOST
    assert list(tmp_path.iterdir()) == []


def test_a_rendezvous_file_goes_and_its_directory_only_once_empty(tmp_path):
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    for d in (alone, shared):
        d.mkdir()
        (d / "rendezvous").write_bytes(b"")
    (shared / "other").write_bytes(b"not the rank's")
    assert fail_fast_after_registering(alone / "rendezvous", shared / "rendezvous") == EXIT_RANK_LOST
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    assert [p.name for p in shared.iterdir()] == ["other"]


def test_a_path_already_gone_is_no_error(tmp_path):
    assert fail_fast_after_registering(tmp_path / "gone", tmp_path / "gone-too" / "rendezvous") == EXIT_RANK_LOST
