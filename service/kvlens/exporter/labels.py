"""The closed sets of label values kvlens exports (``model``, ``tenant``): one rule for each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvlens.records import valid_label

OTHER_MODEL: Final = "other"  # the overflow value of every closed label


class ClosedLabels:
    """The closed set of one label's values (``model``, ``tenant``): an allow-list, or the first
    ``capacity`` names seen. Everything else becomes ``other`` (the last index), and so does a name
    that is ``other`` itself (the overflow value is reserved: it never takes a slot of its own, so
    no series is exported twice) or that is not a valid label value. The one rule of every
    bounded label kvlens exports."""

    def __init__(self, allowed: Sequence[str], capacity: int, default: str) -> None:
        self.fixed = bool(allowed)
        self.capacity = len(allowed) if self.fixed else capacity
        self.default = default
        self.names: list[str] = list(allowed)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.other = self.capacity

    def index_of(self, name: str) -> int:
        """Label index for ``name``; admits new names while there is room. Call under a lock."""
        found = self._index.get(name)
        if found is not None:
            return found
        if self.fixed or len(self.names) >= self.capacity or name == OTHER_MODEL or not valid_label(name):
            return self.other
        self._index[name] = len(self.names)
        self.names.append(name)
        return self._index[name]

    def label(self, index: int) -> str:
        return OTHER_MODEL if index == self.other else self.names[index]
