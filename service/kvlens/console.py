"""The ``kvlens`` console script: the command line, or a clear word when only the plugin is here.

The bare ``pip install kvlens`` is the vLLM plugin alone (standard library only); every command
needs the ``serve`` extra. Importing the command line without it would end in a traceback about
``numpy`` or ``uvicorn``, so this entry imports it and says what to install instead.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from kvlens.errors import MissingExtra

# The serve extra's modules (pyproject.toml): every command imports some of them, but only when it
# runs (so that `kvlens --help` imports none), which would be a traceback deep in a command.
SERVE_MODULES = (
    "numpy", "pydantic", "pydantic_settings", "orjson", "msgspec", "yaml", "httpx", "h11", "anyio",
    "fastapi", "uvicorn", "prometheus_client",
)  # fmt: skip


def _missing_module() -> str | None:
    """The first of the serve extra's modules that is not installed (looked up, not imported)."""
    for name in SERVE_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def main(argv: Sequence[str] | None = None) -> int:
    missing = _missing_module()
    if missing is not None:
        what = f"the command line ({missing} is not installed)"
        print(f"kvlens: {MissingExtra(what, 'serve')}", file=sys.stderr)
        return 2
    try:
        from kvlens.cli import main as run
    except ModuleNotFoundError as error:
        if (error.name or "kvlens").split(".")[0] == "kvlens":
            raise
        # the bare install is the vLLM plugin alone: every command is the serve extra's
        what = f"the command line ({error.name} is not installed)"
        print(f"kvlens: {MissingExtra(what, 'serve')}", file=sys.stderr)
        return 2
    return run(argv)
