"""kvlens: is your prefix cache actually paying off? Correctly defined prefix-cache numbers for
vLLM and SGLang fleets, as Prometheus metrics and offline reports."""


def __getattr__(name: str) -> str:
    """``__version__``, looked up when first read: importing ``importlib.metadata`` and finding
    the distribution cost ~0.2 CPU s, at every start of every command otherwise."""
    if name != "__version__":
        raise AttributeError(f"module 'kvlens' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("kvlens")
    except PackageNotFoundError:  # running from a source tree
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
