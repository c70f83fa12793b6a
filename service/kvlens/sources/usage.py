"""One reader of an OpenAI ``usage`` object, for every kvlens path that reads one: a gateway's log
line (the ``openai-usage`` format, :mod:`kvlens.sources.formats`) and the answer the experiment's
client streams (:mod:`kvlens.experiment.client`).

Names: both APIs'. Chat Completions and Completions write ``prompt_tokens``, ``completion_tokens``
and ``prompt_tokens_details.cached_tokens``; the Responses API ``input_tokens``,
``output_tokens`` and ``input_tokens_details.cached_tokens``. Each count is the first of its two
names that holds something other than ``null``, the Chat name first.

Values, one rule for both callers:

- missing or ``null`` (or a ``*_details`` that is not an object): not reported. vLLM before 0.24
  leaves ``prompt_tokens_details`` out when nothing was cached, and without
  ``--enable-prompt-tokens-details`` always: the caller decides whether a cached count not
  reported is 0 (``missing_cached_is_zero``) or missing;
- anything else is returned as it was read, never converted: a count is a JSON integer (``true``,
  ``2.0`` and ``"2"`` are none) from 0 to the record's bound
  (:data:`kvlens.records.MAX_TOKENS`), and the cached count no more than the prompt's.
  :meth:`Usage.invalid` names the first count that breaks this. A log line's record is refused by
  the record validation for the same reasons (naming the field: ``not_an_integer``,
  ``out_of_range``); the client records the request as ``invalid_usage``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlens.records import MAX_TOKENS

# (Chat/Completions name, Responses name) of each count, and of the object holding the cached one
PROMPT = ("prompt_tokens", "input_tokens")
OUTPUT = ("completion_tokens", "output_tokens")
DETAILS = ("prompt_tokens_details", "input_tokens_details")


@dataclass(frozen=True)
class Usage:
    """The counts a ``usage`` object reports, named as a kvlens record names them; ``None``: not
    reported. Values as read (see the module's rule)."""

    prompt_tokens: Any = None
    cached_tokens: Any = None
    output_tokens: Any = None

    def counts(self) -> dict[str, Any]:
        """The reported counts, by record field."""
        return {name: value for name, value in vars(self).items() if value is not None}

    def invalid(self, sent_prompt_tokens: int | None = None) -> str | None:
        """The first count that cannot be, or None: not a whole number from 0 to the record's
        bound, or a cached count past the prompt's (the reported one, else ``sent_prompt_tokens``)."""
        for name, value in self.counts().items():
            if not _count(value):
                return name
        prompt = self.prompt_tokens if self.prompt_tokens is not None else sent_prompt_tokens
        if self.cached_tokens is not None and prompt is not None and self.cached_tokens > prompt:
            return "cached_tokens"
        return None


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKENS  # exactly int: a bool is no count


def _first(usage: Mapping[str, Any], names: tuple[str, str]) -> Any:
    for name in names:
        value = usage.get(name)
        if value is not None:
            return value
    return None


def read_usage(usage: Mapping[str, Any]) -> Usage:
    """The counts of one ``usage`` object, either API's names."""
    cached = None
    for name in DETAILS:
        details = usage.get(name)
        if isinstance(details, Mapping) and details.get("cached_tokens") is not None:
            cached = details["cached_tokens"]
            break
    return Usage(_first(usage, PROMPT), cached, _first(usage, OUTPUT))
