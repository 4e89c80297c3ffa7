"""Benchmarks: perf_analyzer sweeps, in-process ceilings, the shared-memory comparison, reports."""
