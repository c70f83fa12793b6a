"""What each session's stores cost, by cause: vLLM 0.33's ``session_id`` on ``BlockStored``.

vLLM names on each store the request context that stored (or, with ``kv_cache_report_mode``,
reused) its blocks (``session_id``). With ``kv_events_sessions`` > 0 the index keeps, for the
most recent that many sessions, the replica that stored for it last and the tokens of its GPU
stores by cause (:data:`kvlens.fleet.causes.CAUSES`): what the per-request view reads for a
request that names its session (:meth:`SessionLedger.get`, the one function to call).

Bounds: a session id is outside input (free text), so it is never a label nor logged; one longer
than :data:`MAX_SESSION_CHARS` is not kept (counted in :attr:`SessionLedger.too_long`); past the
cap the least recently stored-for session is forgotten (counted in :attr:`SessionLedger.forgotten`).
An entry costs about 440 bytes with a 36-character id, at most
:data:`~kvlens.fleet.limits.SESSION_BYTES` with the longest (10,000 sessions: 4.4 to 15 MB).

Cost: a payload carrying a session id goes msgspec's path (the compiled loop applies a payload in
one call, not an event at a time), about 1.3-1.6 times the CPU a block (bench/kv_events.py); so it
is off by default.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

MAX_SESSION_CHARS: Final = 256


@dataclass
class SessionView:
    replica: str  # the replica that stored for it last
    tokens: dict[str, int]  # cause -> tokens of its GPU stores (every cause, 0 included)


class SessionLedger:
    """The last ``capacity`` sessions' stores; fed and read under the index's lock."""

    def __init__(self, capacity: int, causes: tuple[str, ...]) -> None:
        self.capacity = capacity
        self.causes = causes
        self._sessions: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        self.too_long = 0
        self.forgotten = 0

    def add(self, session_id: str, replica: str, tokens: list[int]) -> None:
        """A store for ``session_id`` on ``replica``: ``tokens`` by cause (:attr:`causes`' order)."""
        if len(session_id) > MAX_SESSION_CHARS:
            self.too_long += 1
            return
        entry = self._sessions.pop(session_id, None)
        if entry is None:
            totals = tokens
            if len(self._sessions) >= self.capacity:
                self._sessions.popitem(last=False)
                self.forgotten += 1
        else:
            totals = [a + b for a, b in zip(entry[1], tokens, strict=True)]
        self._sessions[session_id] = (replica, totals)

    def get(self, session_id: str) -> SessionView | None:
        """What the session's stores cost, or None (never seen, or forgotten)."""
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        return SessionView(entry[0], dict(zip(self.causes, entry[1], strict=True)))

    def __len__(self) -> int:
        return len(self._sessions)
