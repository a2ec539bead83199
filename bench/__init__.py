"""Benchmarks (not tests): `python -m bench.ledger`, `python -m bench.api`. See docs/performance.md."""
