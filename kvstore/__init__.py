"""Tidekv's KV store: block keys and payloads, tiered storage (device/DRAM/SSD) with eviction,
the global block index and worker registry, and the transfer engine that moves KV between
workers. Workers embed it as a library; see docs/architecture.md for where it sits.
"""
