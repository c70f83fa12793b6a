"""The ``kvlens`` console script: the command line, or a clear word when only the plugin is here.

The bare ``pip install kvlens`` is the vLLM plugin alone (standard library only); every command
needs the ``serve`` extra. Importing the command line without it would end in a traceback about
``numpy`` or ``uvicorn``, so this entry imports it and says what to install instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvlens.errors import MissingExtra


def main(argv: Sequence[str] | None = None) -> int:
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
