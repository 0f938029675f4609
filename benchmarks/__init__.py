"""Benchmark suite for dapo_ops (not part of the package or of the test suite).

Run ``python -m benchmarks.run --help``; see docs/benchmarks.md for the latest results.
"""
