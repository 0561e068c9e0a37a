"""kvtether's policy daemon: job-aware scheduling decisions for vLLM engines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtether")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
