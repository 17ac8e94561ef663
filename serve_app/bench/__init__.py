"""Benchmarks: workloads, measurements and reports for `serve-app bench ...`."""
