"""Benchmarks: ``python -m bench [overhead] [--quick]``. See BENCHMARKS.md."""
