"""Metrics: the node's Prometheus exporter and its families.
"""
