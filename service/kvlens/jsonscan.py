"""The structure of a JSON text, found without decoding it: where its top-level values are separated,
how many keys its top-level object has, how deep it nests.

Decoding a hostile body to find out how many records it holds costs what the attack wants it to
cost: ``[{},{},...]`` is 3 bytes a record on the wire and about 60 bytes a record as Python objects.
This scan looks at bytes only, with numpy, in slices of :data:`SLICE_BYTES`, so its memory is a
few times the slice whatever the text holds, and it takes a few milliseconds per MiB. The caller
then refuses a body with too many records before anything is decoded, and decodes the others one
element at a time.

Strings are tracked like a JSON tokenizer does: a quote preceded by an odd run of backslashes is
escaped; structural characters inside strings are ignored. The scan does not validate JSON; a
decoder does that on each element, through :func:`decode`, so that depth is never an error of its
own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

SLICE_BYTES: Final = 256 * 1024
T = TypeVar("T")
B = TypeVar("B", bytes, memoryview)  # the text, and what the decoder takes
_OBJECT, _ARRAY, _CLOSE, _COMMA, _COLON = 1, 2, 3, 4, 5
_KIND: Final = np.zeros(256, np.int8)
for _char, _kind in (
    (b"{", _OBJECT),
    (b"[", _ARRAY),
    (b"}", _CLOSE),
    (b"]", _CLOSE),
    (b",", _COMMA),
    (b":", _COLON),
):
    _KIND[_char[0]] = _kind
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WHITESPACE: Final = b" \t\r\n"


@dataclass(frozen=True)
class Structure:
    separators: npt.NDArray[np.int64] | None  # offsets of the top-level commas; None past the limit
    separator_count: int  # top-level commas, always counted
    keys: int  # keys of the top-level object (colons at depth 1)
    objects_at_depth: int  # objects opened at the depth asked for (e.g. OTLP spans at 7)
    max_depth: int
    end: int  # offset just after the structural character that closed the top-level value
    balanced: bool  # one top-level array or object, closed, with only whitespace after it
    complete: bool  # False when the scan stopped early: unbalanced, or past the separator limit


@dataclass(frozen=True)
class Tokens:
    """Structural characters outside strings in one slice: offsets in the slice, kinds, and the
    depth after each (1 inside the top-level array or object)."""

    offsets: npt.NDArray[np.intp]
    kinds: npt.NDArray[np.int8]
    depths: npt.NDArray[np.int32]


class Tokenizer:
    """Finds the structural characters of a JSON text fed slice by slice; what it carries from
    one slice to the next is three numbers (depth, inside a string, an escape pending)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped_first = False  # the slice starts right after an odd run of backslashes

    def feed(self, piece: bytes | memoryview) -> Tokens:
        chunk = np.frombuffer(piece, np.uint8)
        quotes = np.flatnonzero(chunk == _QUOTE)
        backslashes = np.flatnonzero(chunk == _BACKSLASH)
        if backslashes.size or self.escaped_first:
            escaped, self.escaped_first = _escaped(backslashes, chunk.size, self.escaped_first)
            if escaped.size and quotes.size:
                quotes = quotes[~np.isin(quotes, escaped, assume_unique=True)]
        structural = np.flatnonzero(_KIND[chunk])
        if structural.size:
            outside = (np.searchsorted(quotes, structural).astype(np.int32) + self.in_string) % 2 == 0
            structural = structural[outside]
        self.in_string = bool((self.in_string + quotes.size) % 2)
        kinds = _KIND[chunk[structural]]
        steps = (kinds <= _ARRAY).astype(np.int32) - (kinds == _CLOSE)
        depths = self.depth + np.cumsum(steps, dtype=np.int32)
        if depths.size:
            self.depth = int(depths[-1])
        return Tokens(structural, kinds, depths)


def scan(
    text: bytes,
    separator_limit: int = 0,
    *,
    stop_past_limit: bool = False,
    object_depth: int = 0,
    object_limit: int | None = None,
) -> Structure:
    """The structure of ``text``; top-level comma offsets are kept while there are at most
    ``separator_limit`` of them (with ``stop_past_limit``, the scan ends there). Objects opened at
    ``object_depth`` are counted (past ``object_limit``, the scan ends). A scan that finds the text
    unbalanced ends at once."""
    separators: list[npt.NDArray[np.int64]] | None = []
    separator_count = keys = max_depth = objects_at_depth = 0
    tokenizer = Tokenizer()
    end = -1
    balanced = complete = True
    view = memoryview(text)
    for start in range(0, len(text), SLICE_BYTES):
        tokens = tokenizer.feed(view[start : start + SLICE_BYTES])
        kinds, depths = tokens.kinds, tokens.depths
        if not kinds.size:
            continue
        max_depth = max(max_depth, int(depths.max()))
        closing = np.flatnonzero(depths <= 0)
        if closing.size:
            if depths.min() < 0 or end >= 0 or closing.size > 1 or kinds[closing[0]] != _CLOSE:
                balanced = False
            end = start + int(tokens.offsets[closing[0]]) + 1
        top_commas = tokens.offsets[(kinds == _COMMA) & (depths == 1)]
        separator_count += top_commas.size
        keys += int(np.count_nonzero((kinds == _COLON) & (depths == 1)))
        if object_depth:
            objects_at_depth += int(np.count_nonzero((kinds == _OBJECT) & (depths == object_depth)))
        if separators is not None:
            separators.append(top_commas + start)
            if separator_count > separator_limit:
                separators = None
        if (
            not balanced
            or (stop_past_limit and separator_count > separator_limit)
            or (object_limit is not None and objects_at_depth > object_limit)
        ):
            complete = False
            break
    balanced = (
        balanced
        and complete
        and tokenizer.depth == 0
        and not tokenizer.in_string
        and end > 0
        and not text[end:].strip(_WHITESPACE)
    )
    return Structure(
        separators=None if separators is None else np.concatenate([np.zeros(0, np.int64), *separators]),
        separator_count=separator_count,
        keys=keys,
        objects_at_depth=objects_at_depth,
        max_depth=max_depth,
        end=end,
        balanced=balanced,
        complete=complete,
    )


def decode(decoder: Callable[[B], T], text: B) -> T:
    """``decoder(text)`` for any JSON decoder of outside text (msgspec's, the standard library's),
    where text nested deeper than the decoder recurses (about 1,000 levels; records nest 2) is
    malformed like any other: :class:`msgspec.DecodeError`, a ValueError, never the RecursionError
    that would reach the client as a 500. The interpreter's recursion check raised it before any
    stack ran out, so it is safe to catch."""
    try:
        return decoder(text)
    except RecursionError:
        raise msgspec.DecodeError("JSON nested too deep") from None


def _escaped(
    backslashes: npt.NDArray[np.intp], size: int, escaped_first: bool
) -> tuple[npt.NDArray[np.intp], bool]:
    """Offsets of the characters that a backslash escapes, and whether the next slice's first is."""
    if not backslashes.size:
        return np.array([0]), False  # escaped_first: the first character is escaped, no run here
    breaks = np.flatnonzero(np.diff(backslashes) != 1)
    starts = backslashes[np.concatenate(([0], breaks + 1))]
    ends = backslashes[np.concatenate((breaks, [backslashes.size - 1]))]
    lengths = ends - starts + 1
    escaped_alone = np.zeros(0, np.intp)
    if escaped_first:
        if starts[0] == 0:
            lengths[0] -= 1  # the first backslash is itself escaped by the previous slice
        else:
            escaped_alone = np.array([0])
    odd = lengths % 2 == 1
    following = ends[odd] + 1
    carry = bool(following.size and following[-1] == size)
    return np.concatenate((escaped_alone, following[following < size])), carry


def array_elements(text: bytes, structure: Structure) -> list[bytes]:
    """The elements of the top-level array ``text``, scanned and balanced, with separators kept."""
    if structure.separators is None:
        raise ValueError("the separators were not kept: scan with a higher separator_limit")
    first = text.index(b"[") + 1
    last = structure.end - 1
    if not structure.separator_count and not text[first:last].strip(_WHITESPACE):
        return []
    starts = [first, *(structure.separators + 1).tolist()]
    stops = [*structure.separators.tolist(), last]
    return [text[begin:stop].strip(_WHITESPACE) for begin, stop in zip(starts, stops, strict=True)]


class FieldExtractor:
    """The small top-level fields of a JSON object too long to hold, kept while it streams past;
    and, when asked, the elements of some of its array fields, handed out one at a time.

    A log line can be megabytes for a field kvlens does not read (SGLang's ``request_parameters``
    holds the whole prompt). Fed slice by slice, this keeps each top-level ``"key": value`` whose
    value is at most ``value_limit`` bytes, up to ``total_limit`` bytes in all, and drops the rest
    unread; :meth:`finish` gives them back as one small JSON object, or None when the text was not
    a JSON object. A field named in ``arrays`` whose value is an array is not kept: :meth:`feed`
    returns ``(name, None)`` where it starts and ``(name, element's text)`` for each of its
    elements (undecoded; an empty text where a comma had no element before it), so that a caller
    decodes and reduces one element at a time (a benchmark tool's result: one object of
    per-request arrays). An element longer than ``element_limit`` bytes is ``too_long(name)``'s to
    refuse (it raises). Memory: the limits and one element, whatever the text's size.

    After the object, :attr:`values` counts the top-level values the text held (several: JSON
    lines, as ``vllm bench serve --append-result`` writes), while they stay balanced.
    """

    KEY_LIMIT: Final = 1024

    def __init__(
        self,
        value_limit: int = 4096,
        total_limit: int = 64 * 1024,
        *,
        arrays: Collection[str] = (),
        element_limit: int = 0,
        too_long: Callable[[str], None] | None = None,
    ) -> None:
        self._tokenizer = Tokenizer()
        self._value_limit = value_limit
        self._total_limit = total_limit
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self._key = bytearray()
        self._value = bytearray()
        self._in_value = False
        self._overflow = False  # the current key or value is over its limit: drop the pair
        self._state = "before"  # before the opening brace, inside, after the closing one, more, or broken
        self._arrays = frozenset(arrays)
        self._element_limit = element_limit
        self._too_long = too_long
        self._array: str | None = None  # the field in ``arrays`` whose elements stream past now
        self._element = bytearray()
        self._commas = 0  # in the array streaming past
        self.values = 0

    def feed(self, piece: bytes) -> list[tuple[str, bytes | None]]:
        elements: list[tuple[str, bytes | None]] = []
        if self._state == "broken" or not piece:
            return elements
        if self._state == "after":
            if not piece.strip(_WHITESPACE):
                return elements
            self._state = "more"
        tokens = self._tokenizer.feed(piece)
        shallow = tokens.depths <= 2  # nothing deeper is acted on: a list of numbers is thousands of commas
        cursor = 0
        for offset, kind, depth in zip(
            tokens.offsets[shallow].tolist(),
            tokens.kinds[shallow].tolist(),
            tokens.depths[shallow].tolist(),
            strict=True,
        ):
            if self._state == "more":  # only counted: a value after the object
                if depth < 0:
                    self._state = "broken"
                    return elements
                self.values += depth == 0 and kind == _CLOSE
                continue
            if self._state == "before":
                if kind != _OBJECT or piece[:offset].strip(_WHITESPACE):
                    self._state = "broken"
                    return elements
                self._state, cursor = "inside", offset + 1
                continue
            if self._array is not None:
                if depth == 2 and kind == _COMMA:
                    elements.append((self._array, self._element_text(piece[cursor:offset])))
                    self._commas += 1
                    cursor = offset + 1
                elif depth == 1 and kind == _CLOSE:
                    last = self._element_text(piece[cursor:offset])
                    if last or self._commas:
                        elements.append((self._array, last))
                    self._array, cursor = None, offset + 1
                continue  # deeper: inside an element
            if depth == 1 and kind == _COLON and not self._in_value:
                self._take(piece[cursor:offset])
                self._in_value, cursor = True, offset + 1
            elif depth == 2 and kind == _ARRAY and self._in_value and not self._overflow:
                name = self._wanted(piece[cursor:offset])
                if name is not None:
                    elements.append((name, None))
                    self._array, self._commas, self._overflow = name, 0, True  # streamed, not kept
                    cursor = offset + 1
            elif (depth == 1 and kind == _COMMA) or (depth == 0 and kind == _CLOSE):
                self._take(piece[cursor:offset])
                self._commit()
                cursor = offset + 1
                if depth == 0:
                    self._state, self.values = "after", 1
                    if piece[cursor:].strip(_WHITESPACE):
                        self._state = "more"
                        continue
                    return elements
        if self._state == "before":
            if piece.strip(_WHITESPACE):
                self._state = "broken"
        elif self._array is not None:
            self._element_text(piece[cursor:], partial=True)
        elif self._state == "inside":
            self._take(piece[cursor:])
        return elements

    @property
    def broken(self) -> bool:
        """The text is no JSON object (or what follows it is no JSON value): reading on is no use."""
        return self._state == "broken"

    def finish(self) -> bytes | None:
        """The kept fields as a JSON object, or None when the text was not one."""
        if self._state != "after":
            return None
        return b"{" + b",".join(self._kept) + b"}"

    def _wanted(self, before: bytes) -> str | None:
        """The field's name when it is one of ``arrays`` and its value starts here."""
        if not self._arrays or self._value.strip(_WHITESPACE) or before.strip(_WHITESPACE):
            return None
        try:
            name = msgspec.json.decode(bytes(self._key))
        except msgspec.DecodeError:
            return None
        return name if isinstance(name, str) and name in self._arrays else None

    def _element_text(self, part: bytes, *, partial: bool = False) -> bytes:
        """The element that ends with ``part`` (or, ``partial``, goes on past it)."""
        if len(self._element) + len(part) > self._element_limit and self._too_long is not None:
            self._too_long(self._array or "")
        self._element += part
        if partial:
            return b""
        text = bytes(self._element).strip(_WHITESPACE)
        self._element.clear()
        return text

    def _take(self, part: bytes) -> None:
        if self._overflow or not part:
            return
        buffer, limit = (self._value, self._value_limit) if self._in_value else (self._key, self.KEY_LIMIT)
        if len(buffer) + len(part) > limit:
            self._overflow = True
            return
        buffer += part

    def _commit(self) -> None:
        pair = bytes(self._key) + b":" + bytes(self._value)
        if self._in_value and not self._overflow and self._kept_bytes + len(pair) <= self._total_limit:
            self._kept.append(pair)
            self._kept_bytes += len(pair) + 1
        self._key.clear()
        self._value.clear()
        self._in_value = self._overflow = False
