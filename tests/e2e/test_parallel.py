"""Instances of different parallel shapes in one cluster, real processes: a TP=2 prefill
instance feeding a TP=1 decode instance and a TP=1 prefill instance feeding a TP=2 one, both
token-exact against ``engine.generate``; a prefix cached by the TP=2 instance reused (pulled) by
the TP=1 one and the reverse; an EP=2 decode instance; each group registered once, with its
shape, its ranks alive as processes of its own.

    prefill-0  TP=2 (2 processes)  ─┐        ┌─ decode-0  TP=1
    prefill-1  TP=1                ─┴ round ─┴─ decode-1  TP=2 (2 processes)
                                      robin
"""

from __future__ import annotations

from pathlib import Path

import pytest

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all, wait_all_freed

pytestmark = pytest.mark.timeout(300)
SHAPES = {"prefill-0": ("--tp", "2"), "decode-1": ("--tp", "2")}


def rank_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (a parallel instance's other ranks)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


@pytest.fixture(scope="module")
def mixed():
    config = ClusterConfig(num_prefill=2, num_decode=2, policy="round_robin", prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS, instance_args=SHAPES)
    with LocalCluster(config) as cluster:
        yield cluster


def test_each_group_registers_once_with_its_shape(mixed):
    workers = {w.worker_id: w for w in mixed.workers().workers}
    assert sorted(workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert {w: workers[w].tp_size for w in workers} == {"prefill-0": 2, "prefill-1": 1, "decode-0": 1, "decode-1": 2}
    procs = mixed.procs
    assert len(rank_pids(procs["prefill-0"].pid)) == 1 and len(rank_pids(procs["decode-1"].pid)) == 1
    assert rank_pids(procs["prefill-1"].pid) == [] and rank_pids(procs["decode-0"].pid) == []


def test_tp2_prefill_to_tp1_decode_and_the_reverse_token_exact(mixed, reference):
    prompts = [prompt(60 + 41 * i, 300 + i) for i in range(4)]
    outs = run_all(mixed.endpoint, [Client.request(p, max_tokens=16) for p in prompts])
    for p, out in zip(prompts, outs, strict=True):
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == engine.generate(reference, p, 16)
    pairs = {(o.prefill_worker, o.decode_worker) for o in outs}
    assert {("prefill-0", "decode-0"), ("prefill-1", "decode-1")} <= pairs, pairs
    seeded = [Client.request(p, max_tokens=16, temperature=0.8, top_p=0.9, seed=4) for p in prompts[:2]]
    for p, out in zip(prompts[:2], run_all(mixed.endpoint, seeded), strict=True):
        assert out.token_ids == engine.generate(reference, p, 16, temperature=0.8, top_p=0.9, seed=4)
    wait_all_freed(mixed)


def _on(cluster, worker: str, ids: list[int], max_tokens: int = 8):
    """``ids`` sent so that round robin (prefill ``seq % 2``) puts it on prefill worker ``worker``:
    throwaway one-block requests first turn the rotation; the request's result."""
    for salt in range(2):
        probe = run_all(cluster.endpoint, [Client.request(prompt(8, 900 + salt + len(ids)), max_tokens=1)])[0]
        if probe.prefill_worker != worker:
            break
    out = run_all(cluster.endpoint, [Client.request(ids, max_tokens=max_tokens)])[0]
    assert out.prefill_worker == worker, out
    return out


@pytest.mark.parametrize("holder,puller", [("prefill-0", "prefill-1"), ("prefill-1", "prefill-0")])
def test_a_prefix_cached_by_one_shape_is_reused_by_the_other(mixed, reference, holder, puller):
    """Blocks are stored in one canonical layout: the TP=2 instance's (its KDA state gathered
    from both ranks) serve the TP=1 one, and the TP=1 instance's serve the TP=2 one (cut by
    head on the way in)."""
    salt = 500 if holder == "prefill-0" else 600
    shared = prompt(192, salt)
    first = _on(mixed, holder, shared + [7, 8, 9])
    assert first.token_ids == engine.generate(reference, shared + [7, 8, 9], 8)
    second_ids = shared + prompt(40, salt + 1)
    second = _on(mixed, puller, second_ids, max_tokens=12)
    assert second.pulled_from == holder and second.cached_tokens >= 128, second
    assert second.token_ids == engine.generate(reference, second_ids, 12)
    wait_all_freed(mixed)


def test_ep2_decode_instance_token_exact(reference):
    config = ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS,
                           decode_args=DECODE_ARGS + ("--ep", "2"))
    with LocalCluster(config) as cluster:
        assert [w.ep_size for w in cluster.workers().workers if w.worker_id == "decode-0"] == [2]
        prompts = [prompt(50 + 30 * i, 700 + i) for i in range(3)]
        outs = run_all(cluster.endpoint, [Client.request(p, max_tokens=20) for p in prompts])
        for p, out in zip(prompts, outs, strict=True):
            assert out.token_ids == engine.generate(reference, p, 20), out.error
        wait_all_freed(cluster)
