"""The node: the composition root that builds a daemon from its settings and runs it.

The only package that imports all the others; only the command line imports it.
"""
