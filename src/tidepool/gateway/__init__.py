"""The gateway: the worker protocol (/w1) on a mutual-TLS listener of its own, for remote workers that hold
no database credentials, and its side of the worker registry. Its modules are imported by what they hold
(the node hands the API's document the protocol's description, openapi.py, without the listener)."""
