"""Whether numba can cache the compiled loops (:data:`CACHE`, each loop's ``cache=``).

numba caches a loop beside its source (``__pycache__``), else under ``NUMBA_CACHE_DIR``, else
under the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``), and refuses to even
declare a ``cache=True`` loop when none of them is writable ("no locator available"): an image
with a read-only package and a read-only ``HOME`` could not import the fleet index. There the
loops are compiled in memory at each start instead (:func:`kvlens.fleet.kernels.warm` says so
once, with the setting that gives them a cache)."""

from __future__ import annotations

from typing import Final

from numba import njit


def _probe() -> int:  # beside the loops: numba picks a cache directory by the source's
    return 0


def _cacheable() -> bool:
    """Declaring a loop with a cache picks its directory (writing a file there to be sure), and
    compiles nothing."""
    try:
        njit(cache=True)(_probe)
    except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
        return False
    return True


CACHE: Final = _cacheable()
