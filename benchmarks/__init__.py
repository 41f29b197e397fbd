"""The benchmark suite of tracejit: `python benchmarks/run.py` (see docs/performance.md)."""
