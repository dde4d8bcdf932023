"""Execution: runs attempts through their phases, the same on a node and on a remote worker.

It reaches storage only through the worker port (store.port), so a remote worker runs it unchanged over
its gateway.
"""
