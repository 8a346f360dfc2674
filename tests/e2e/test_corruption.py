"""Corrupted KV end to end, through real processes (``LocalCluster``): the answer stays
token-exact with the single-process engine, and the corruption is counted and logged.

- On the wire: the prefill worker corrupts one outgoing KV frame (the test-only
  ``PrefillConfig.fault_corrupt_frame``, set as ``TIDEKV_FAULT_CORRUPT_FRAME``); the decode worker's
  receiver finds the checksum mismatch, the prefill fails as a TRANSFER failure and the
  Conductor routes the request again, which then succeeds.
- On the SSD tier: bytes flipped in one block file under the prefill worker's data dir; the
  next request that reuses the prefix finds the block corrupt, drops it (a "removed" event for
  the index) and recomputes from the last intact snapshot; a later request reuses the whole
  prefix again, the recomputed block included.
"""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import engine
from conductor.client import Client
from deploy.local import ClusterConfig, LocalCluster
from tests.e2e.conftest import BLOCK, DECODE_ARGS, WORKER_ARGS
from tests.e2e.helpers import prompt, run_all, wait_all_freed

CORRUPTION = "tidekv:kv_corruption"  # a counter: its sample is tidekv:kv_corruption_total


def corruption_count(cluster: LocalCluster, worker_id: str, where: str) -> float:
    """``tidekv:kv_corruption_total{worker_id, where}`` summed over every process's /metrics."""
    total = 0.0
    for address in cluster.metrics_addresses():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read().decode()
        for fam in text_string_to_metric_families(text):
            if fam.name != CORRUPTION:
                continue
            for sample in fam.samples:
                if (sample.name.endswith("_total") and sample.labels.get("worker_id") == worker_id
                        and sample.labels.get("where") == where):
                    total += sample.value
    return total


def log_of(cluster: LocalCluster, name: str) -> str:
    return (cluster.data_dir / "logs" / f"{name}.log").read_text()


def assert_all_freed(cluster: LocalCluster) -> None:
    for name, s in wait_all_freed(cluster).items():
        assert s.num_live_requests == 0 and s.num_free_pages == s.num_pages_total, name


def test_corrupted_kv_frame_is_detected_and_the_request_retried_token_exact(reference):
    env = {"TIDEKV_FAULT_CORRUPT_FRAME": "2"}  # the 2nd frame of the worker's first connection
    with LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=WORKER_ARGS,
                                    decode_args=DECODE_ARGS, env=env)) as c:
        assert corruption_count(c, "decode-0", "transfer") == 0
        ids = prompt(70, 5000)
        out = run_all(c.endpoint, [Client.request(ids, max_tokens=8)])[0]
        assert out.num_terminal == 1 and out.finish_reason == "length", out.error
        assert out.token_ids == engine.generate(reference, ids, 8)
        assert corruption_count(c, "decode-0", "transfer") == 1
        decode_log = log_of(c, "decode-0")
        assert "checksum mismatch" in decode_log and "corrupted in transit" in decode_log
        assert f"request {out.request_id}" in log_of(c, "conductor")  # the retry, naming the request
        assert "retrying elsewhere" in log_of(c, "conductor")
        # The fault fires once: the next request goes through on the first attempt.
        again = prompt(40, 5001)
        out2 = run_all(c.endpoint, [Client.request(again, max_tokens=5)])[0]
        assert out2.token_ids == engine.generate(reference, again, 5)
        assert corruption_count(c, "decode-0", "transfer") == 1
        assert_all_freed(c)


def test_corrupt_ssd_block_is_dropped_and_recomputed_token_exact(reference):
    # No device tier, and 64 KiB of DRAM holds three plain blocks (~20 KiB) and no snapshot block
    # (~320 KiB): the snapshot blocks go to SSD at once and older plain blocks are demoted there.
    args = WORKER_ARGS + ("--device-bytes", "0", "--dram-bytes", str(64 << 10))
    with LocalCluster(ClusterConfig(num_prefill=1, num_decode=1, prefill_args=args,
                                    decode_args=DECODE_ARGS)) as c:
        first = prompt(160, 6000)  # 10 blocks, snapshots after blocks 1, 3, 5, 7, 9
        second = first[:128] + prompt(20, 6001)  # shares blocks 0..7
        run_all(c.endpoint, [Client.request(first, max_tokens=2)])
        keys = c.block_keys(first, BLOCK, reference.fingerprint)
        ssd = c.data_dir / "prefill-0" / "ssd"
        victim = ssd / f"{keys[2].hex()}.blk"  # a plain block, demoted from DRAM
        assert victim.exists(), f"block 2 is not on SSD: {sorted(p.name for p in ssd.iterdir())}"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside its MLA rows
        victim.write_bytes(data)
        assert corruption_count(c, "prefill-0", "ssd") == 0

        damaged = run_all(c.endpoint, [Client.request(second, max_tokens=8)])[0]
        assert damaged.num_terminal == 1 and damaged.finish_reason == "length", damaged.error
        assert damaged.token_ids == engine.generate(reference, second, 8)
        # Blocks 0 and 1 were intact and block 1 carries a snapshot: reuse stops there.
        assert damaged.cached_tokens == 2 * BLOCK
        assert corruption_count(c, "prefill-0", "ssd") == 1
        assert f"block {keys[2].hex()} is corrupt on disk" in log_of(c, "prefill-0")

        # The recomputed block was stored again: the whole shared prefix is reused now.
        third = first[:128] + prompt(20, 6002)
        healed = run_all(c.endpoint, [Client.request(third, max_tokens=8)])[0]
        assert healed.cached_tokens == 8 * BLOCK
        assert healed.token_ids == engine.generate(reference, third, 8)
        assert corruption_count(c, "prefill-0", "ssd") == 1
        assert_all_freed(c)
