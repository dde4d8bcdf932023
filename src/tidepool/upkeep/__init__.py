"""Upkeep: the repairs and clocks that run where the queue is (the reconciler, the scheduler, the fleet's
heartbeats and gone nodes), never on a remote worker, whose queue is its gateway's.
"""
