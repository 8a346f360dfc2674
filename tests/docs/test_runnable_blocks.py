"""The docs check: every command block of README.md and docs/*.md marked runnable runs as
written and succeeds (``tests/docs/runnable.py`` says how blocks are marked and run)."""

from __future__ import annotations

import re

import pytest

from tests.docs.runnable import ROOT, Block, all_blocks, find_blocks, parse_options, run_block

BLOCKS = all_blocks()


def test_the_readme_has_runnable_blocks():
    assert len([b for b in BLOCKS if b.path == ROOT / "README.md"]) >= 2, [b.name for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_runnable_block_succeeds(block: Block, tmp_path):
    out = run_block(block, tmp_path)
    shown = f"{block.name} exited {out.returncode}\n--- as run:\n{out.script}\n--- stdout:\n{out.stdout[-4000:]}" \
            f"\n--- stderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 0, shown
    if block.expect is not None:
        assert re.search(block.expect, out.stdout), f"stdout does not match {block.expect!r}\n{shown}"


def test_markers_are_checked(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text('<!-- runnable: timeout=5 expect="a, b" -->\n```bash\necho "a, b"\n```\n\n<!-- runnable -->\n'
                   "```\nfalse\n```\n\n```bash\nnot marked\n```\n")
    first, second = find_blocks(doc)
    assert first.name == f"{doc}:2" and (first.script, first.timeout_s, first.expect, first.cluster) == (
        'echo "a, b"\n', 5.0, "a, b", None)
    assert second.script == "false\n" and run_block(second, tmp_path / "b").returncode == 1
    out = run_block(first, tmp_path / "a")
    assert out.returncode == 0 and out.stdout == "a, b\n"
    doc.write_text("<!-- runnable -->\nno fence\n")
    with pytest.raises(ValueError, match="right above a ``` fence"):
        find_blocks(doc)
    with pytest.raises(ValueError, match="unknown runnable option 'timout'"):
        parse_options("timout=3", "x")
