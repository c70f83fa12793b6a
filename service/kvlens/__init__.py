"""kvlens: is your prefix cache actually paying off? Correctly defined prefix-cache numbers for
vLLM and SGLang fleets, as Prometheus metrics and offline reports."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvlens")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
