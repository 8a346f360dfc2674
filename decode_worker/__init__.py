"""Decode worker: reserves cache for a request, receives its KV layer by layer from a prefill
worker straight into the reserved pages, then decodes it in a continuously batched loop and
streams its tokens back. Entry point: ``decode_worker.server.serve``.
"""
