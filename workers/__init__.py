"""disagg workers: the inference engine, the PD roles, KV transfer and the HTTP API."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("disagg")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
