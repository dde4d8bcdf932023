"""HTTP pieces the operator's API and the worker gateway share: errors as JSON (refusals), body parsing
(bodies), the connection guard (guard), the answers both write (answers) and how the OpenAPI document
describes an operation of either (openapi). It imports the domain only, never either server.
"""
