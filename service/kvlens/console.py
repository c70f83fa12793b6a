"""The ``kvlens`` console script: the command line, or a clear word when only the plugin is here.

The bare ``pip install kvlens`` is the vLLM plugin alone (standard library only); every command
needs the ``serve`` extra. Importing the command line without it would end in a traceback about
``numpy`` or ``uvicorn``, so this entry imports it and says what to install instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvlens.errors import install_hint


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from kvlens.cli import main as run
    except ModuleNotFoundError as error:
        if (error.name or "kvlens").split(".")[0] == "kvlens":
            raise
        print(
            f"kvlens: the command line needs the sidecar's packages ({error.name} is not installed): "
            f"{install_hint('serve')}; the bare install is only the vLLM plugin",
            file=sys.stderr,
        )
        return 2
    return run(argv)
