"""Benchmarks. Each prints one JSON object and measures its baseline in the same run."""
