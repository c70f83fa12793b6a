"""Every exception kvlens raises on purpose, in one tree.

::

    KVLensError
    ├── SettingsError             invalid settings; every problem listed, no value echoed (exit 2)
    │   └── MissingExtra          a feature asked for whose extra is not installed (what to install)
    ├── InputError                bytes from a client or a file that kvlens will not take
    │   ├── PayloadTooLarge       413: over max_body_bytes, also once decompressed
    │   ├── TooManyRecords        413: over max_records_per_request (records, lines, spans, objects)
    │   ├── CompressionBomb       413: over max_decompression_ratio or max_gzip_members
    │   ├── UnsupportedEncoding   415: a Content-Encoding other than gzip, deflate or identity
    │   ├── UnsupportedMediaType  415: a Content-Type the endpoint cannot read
    │   ├── PayloadUndecodable    400: nothing in the body decodes
    │   ├── BodyTooSlow           408: the body did not arrive within its deadlines or at its pace
    │   ├── Busy                  503 (retry): no room for one more body arriving (max_arriving_bodies)
    │   │   ├── ArrivingBytesFull   bodies still arriving hold max_arriving_body_bytes already
    │   │   └── BodyDisplaced       its place given to a new body, while all are taken, as it fell
    │   │                           behind body_min_bytes_per_second_when_full
    │   ├── ClientDisconnected    499 (never sent): the client went away before its body arrived
    │   ├── NoRecordsOfArm        ``kvlens compare``: a file of several arms holds none of the arm asked for
    │   └── GroupTooLarge         ``kvlens compare``: a group past compare's MAX_GROUP_REQUESTS
    ├── ScrapeError               a scrape of an engine's /metrics failed; ``reason`` is a closed set
    └── ArmsDiffer                ``kvlens compare``: the arms are not replays of one sequence

An :class:`InputError` carries the HTTP status it is answered with. Its message names the rule that
was broken and never quotes what the client sent (header values, record fields), so it is safe in
a response body and in a log line.
"""

from __future__ import annotations

from typing import ClassVar


class KVLensError(Exception):
    """Base of every exception kvlens raises on purpose."""


class SettingsError(KVLensError):
    """Invalid settings; ``str()`` lists every problem, one per line, without the values."""


def install_hint(extra: str) -> str:
    """How to install an extra: kvlens is installed from its repository (a checkout, a git URL or
    a wheel built from it), so both forms are named."""
    return f"pip install 'kvlens[{extra}]' (from a checkout: pip install '.[{extra}]')"


class MissingExtra(SettingsError):
    """``what`` needs the optional packages of ``extra``, not installed here; ``str()`` says how to
    install them (:func:`install_hint`)."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(f"{what} needs the {extra} extra: {install_hint(extra)}")
        self.extra = extra


class InputError(KVLensError):
    status: ClassVar[int] = 400
    reason: ClassVar[str] = "undecodable"  # the label of kvlens_ingest_refused_total


class PayloadTooLarge(InputError):
    status = 413
    reason = "too_large"


class TooManyRecords(InputError):
    status = 413
    reason = "too_many_records"


class CompressionBomb(InputError):
    status = 413
    reason = "compression_bomb"


class UnsupportedEncoding(InputError):
    status = 415
    reason = "unsupported_encoding"


class UnsupportedMediaType(InputError):
    status = 415
    reason = "unsupported_media_type"


class PayloadUndecodable(InputError):
    status = 400
    reason = "undecodable"


class BodyTooSlow(InputError):
    status = 408
    reason = "too_slow"


class Busy(InputError):
    """Retryable, as any 503: the places and bytes that other bodies hold free up as they arrive
    or fail. Answered with ``Retry-After`` and the connection closed (the rest of the body unread)."""

    status = 503
    reason = "busy"


class ArrivingBytesFull(Busy):
    pass


class BodyDisplaced(Busy):
    reason = "displaced"


class ClientDisconnected(InputError):
    """Nobody is left to answer; 499 (nginx's "client closed request") keeps it apart from a 400,
    which would mean the sender's batch was taken."""

    status = 499
    reason = "client_disconnected"


class NoRecordsOfArm(InputError):
    """A file of several arms holds none of the arm asked for."""


class GroupTooLarge(InputError):
    """A group of ``kvlens compare`` holds more timed requests than its bound
    (``analysis.compare.MAX_GROUP_REQUESTS``)."""


class ScrapeError(KVLensError):
    """A failed scrape; ``reason`` is a closed set: timeout, too_large, http_status, connect, parse."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ArmsDiffer(KVLensError, ValueError):
    """``kvlens compare`` arms that are not replays of one request sequence."""
