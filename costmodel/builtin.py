"""The built-in cost estimate for the ``tiny`` model on one CPU thread, used when no
calibration file is given (the Conductor and ``tidekv simulate`` say so when they use it).

Rounded from ``tidekv calibrate --grid full`` on the project's 2-core machines: prefill about
0.9 ms per new token, a decode step about 7 ms plus 0.8 ms per request in the batch.
"""

from __future__ import annotations

from costmodel.model import CostModels

TINY_KV_BYTES_PER_TOKEN = 1280  # 2 MLA layers x (128 latent + 32 rope) x 4 bytes
TINY_SNAPSHOT_BYTES = 299_008  # 4 KDA layers x (4 x 64 x 64 state + 3 x 768 conv) x 4 bytes


def tiny_cpu_estimate() -> CostModels:
    return CostModels.analytic(
        prefill_s_per_token=0.9e-3, prefill_s_per_token_sq=1e-8, reuse_s_per_token=2e-6,
        decode_base_s=7e-3, decode_s_per_request=0.8e-3, decode_s_per_context_token=1e-7,
        transfer_bytes_per_s=1e9, transfer_latency_s=1e-3,
        kv_bytes_per_token=TINY_KV_BYTES_PER_TOKEN, snapshot_bytes=TINY_SNAPSHOT_BYTES)
