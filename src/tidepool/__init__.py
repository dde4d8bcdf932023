"""tidepool: a worker-pool daemon for scanner hosts."""

__version__ = "0.1.0"
