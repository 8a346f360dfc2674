"""Prefill worker: loads a request's reusable prefix (own tiers, or pulled from the holder),
runs chunked prefill over the rest while pushing each layer's KV to the decode worker, samples
the first token, and keeps the new blocks in its tiered store for the cluster to reuse.
Entry point: ``prefill_worker.server.serve``.
"""
