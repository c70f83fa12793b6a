"""What the compiled loops are built from, as one number (:data:`BUILT_FROM`).

numba caches each compiled function keyed by its own file's stamp, blind to the files whose
functions it calls or whose constants it compiles in (a documented limit of its cache): the loops
of :mod:`.rules` call :mod:`.table`'s and :mod:`.msgpack`'s, and :mod:`.msgpack` compiles in the
field tables of :mod:`kvlens.fleet.schema`, the tiers of :mod:`kvlens.fleet.limits` and the
full-attention kinds of :mod:`kvlens.fleet.groups`. So each
of the three compiles in a digest of all those files (its ``built_from()``), and
:func:`kvlens.fleet.kernels.warm` compiles every loop afresh when a cached one was built from
other files than these.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Final

_HERE: Final = Path(__file__).resolve().parent
_SOURCES: Final = (
    _HERE / "table.py",
    _HERE / "msgpack.py",
    _HERE / "rules.py",
    _HERE.parent / "schema.py",
    _HERE.parent / "limits.py",
    _HERE.parent / "groups.py",
)
BUILT_FROM: Final = zlib.crc32(b"".join(path.read_bytes() for path in _SOURCES))
