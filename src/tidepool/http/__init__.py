"""HTTP pieces the operator's API and the worker gateway share: errors as JSON, body parsing, the
connection guard, the response shapes.
"""
