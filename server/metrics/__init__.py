"""Prometheus metrics: the registry of series, the live per-job gauges, and several workers' series on one /metrics."""
