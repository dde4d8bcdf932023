"""tidepool: a worker-pool daemon for scanner hosts.

For plugin authors, `TaskContext` is what a plugin receives; for producers, `Client` talks to a node.
"""

__version__ = "0.1.0"  # before the imports below: modules they load read it

from .client import ApiError, Client, Unreachable
from .execution.context import TaskContext

__all__ = ["ApiError", "Client", "TaskContext", "Unreachable", "__version__"]
