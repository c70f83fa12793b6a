"""The simulated server's toy tokenizer, its chat template, its generated text, and the chained
block keys its prefix cache is keyed on.

Tokens (documented in the README, stable across versions and processes):

- text is its UTF-8 bytes, one token per byte, id = the byte's value (0-255); the three special
  tokens ``<|endoftext|>`` (256), ``<|im_start|>`` (257) and ``<|im_end|>`` (258) are one token
  each where they appear in text, as a real tokenizer parses its special tokens;
- ids from 259 to ``vocab_size - 1`` are valid in token-id prompts and detokenize as ``<|id|>``;
- generated tokens spell :data:`GENERATED` over and over (the simulated model never stops early:
  every answer is ``max_tokens`` long, ``finish_reason`` ``length``).

The chat template is ChatML, as Qwen's models use it: each message is
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the prompt ends with
``<|im_start|>assistant\\n``; every one of those tokens is a prompt token and is cached like any
other.

With ``--tokenizer DIR`` (:class:`HuggingFace`) a Hugging Face tokenizer directory's
``tokenizer.json`` counts and splits text instead, as the benchmark client that reads the same
directory does (``vllm bench serve``, AIPerf); the chat template stays ChatML (a ``chat_template``
in ``tokenizer_config.json`` is Jinja, which the ``tokenizers`` library does not run), and its
special tokens are one token each when the tokenizer has them. :class:`Bytes` is the default.

Block keys: the prompt's full blocks of ``block_size`` tokens, key ``i`` = hash of (key ``i-1``,
the block's token ids): two prompts share key ``i`` exactly when their first ``(i+1) * B`` tokens
are equal (Python hashes tuples of ints the same way in every process, unlike strings).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from kvlens.errors import MissingExtra

ENDOFTEXT: Final = 256
IM_START: Final = 257
IM_END: Final = 258
SPECIAL: Final = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPECIAL_TEXT: Final = {token: text for text, token in SPECIAL.items()}
_SPECIAL_PATTERN: Final = re.compile("|".join(re.escape(text) for text in SPECIAL))
FIRST_PLAIN_ID: Final = 259
DEFAULT_VOCAB_SIZE: Final = 32_000
GENERATED: Final = "The quick brown fox jumps over the lazy dog. "
_GENERATED_IDS: Final = tuple(GENERATED.encode())


def encode(text: str) -> list[int]:
    ids: list[int] = []
    position = 0
    for special in _SPECIAL_PATTERN.finditer(text):
        ids.extend(text[position : special.start()].encode())
        ids.append(SPECIAL[special.group()])
        position = special.end()
    ids.extend(text[position:].encode())
    return ids


def count(text: str) -> int:
    """How many tokens :func:`encode` gives ``text``, without building them (8 bytes a token: a
    16 MiB prompt far past any context would take 128 MiB just to be refused)."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return size - sum(len(special.group()) - 1 for special in _SPECIAL_PATTERN.finditer(text))


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids``; bytes that do not make whole UTF-8 characters become U+FFFD."""
    if not ids or max(ids) < 256:  # bytes only: one C call instead of a loop over a million ids
        return bytes(ids).decode("utf-8", "replace")
    out: list[str] = []
    run = bytearray()
    for token in ids:
        if token < 256:
            run.append(token)
            continue
        if run:
            out.append(run.decode("utf-8", "replace"))
            run.clear()
        out.append(_SPECIAL_TEXT.get(token) or f"<|{token}|>")
    if run:
        out.append(run.decode("utf-8", "replace"))
    return "".join(out)


def generated(count: int, start: int = 0) -> list[int]:
    """Output tokens ``start`` to ``start + count - 1`` of every answer."""
    size = len(_GENERATED_IDS)
    return [_GENERATED_IDS[i % size] for i in range(start, start + count)]


def generated_text(count: int, start: int = 0) -> str:
    size = len(GENERATED)
    if count <= 0:
        return ""
    first = start % size
    whole = GENERATED[first:] + GENERATED * ((first + count) // size + 1)
    return whole[:count]


def chat_prompt(messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The ChatML rendering of (role, content) messages."""
    rendered = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return rendered + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def block_keys(ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained keys of the full blocks of ``ids`` (a partial last block has none)."""
    keys = []
    key = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = hash((key, tuple(ids[start : start + block_size])))
        keys.append(key)
    return tuple(keys)


class Tokenizer(Protocol):
    """What the server asks of a tokenizer: prompts to ids (``special``: add what the tokenizer's
    post-processor adds, as vLLM does for a completions prompt and not for a rendered chat), ids
    to text, and the text of generated tokens, one piece per token."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, special: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def generated_text(self, count: int, start: int = 0) -> str: ...

    def generated_pieces(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Bytes:
    """The byte tokenizer of this module (the default)."""

    vocab_size: int = DEFAULT_VOCAB_SIZE

    def encode(self, text: str, special: bool = True) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)

    def generated_text(self, count: int, start: int = 0) -> str:
        return generated_text(count, start)

    def generated_pieces(self) -> tuple[str, ...]:
        return tuple(GENERATED)


class TokenizerUnavailable(ValueError):
    """``--tokenizer DIR`` without a readable tokenizer.json (the extra missing is a MissingExtra)."""


@dataclass(frozen=True)
class HuggingFace:
    """A Hugging Face tokenizer directory's ``tokenizer.json``, read with the ``tokenizers``
    library (the ``tokenizer`` extra) and nothing else: no model hub, no ``transformers``.

    Generated text: a client counts an answer's tokens by tokenizing the whole text, so each
    generated token's text must stay one token when pieces are joined. The pieces are the words
    of :data:`GENERATED`, each with its leading space, that are one token alone and stay one
    token each when the sentence is repeated; a tokenizer with none of those falls back to the
    text of each of the sentence's tokens (then a client may count the answer a little apart)."""

    path: Path
    backend: Any = field(repr=False)
    vocab_size: int
    pieces: tuple[str, ...]

    @classmethod
    def load(cls, directory: Path) -> HuggingFace:
        try:
            import tokenizers
        except ModuleNotFoundError:
            raise MissingExtra("--tokenizer", "tokenizer") from None
        file = directory / "tokenizer.json" if directory.is_dir() else directory
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # the library raises plain Exception for a bad file
            reason = error.strerror if isinstance(error, OSError) else str(error).splitlines()[0][:200]
            raise TokenizerUnavailable(f"--tokenizer: cannot read {file}: {reason}") from None
        return cls(directory, backend, backend.get_vocab_size(with_added_tokens=True), _pieces(backend))

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=special).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.backend.decode(list(ids), skip_special_tokens=False)
        return text

    def generated_text(self, count: int, start: int = 0) -> str:
        size = len(self.pieces)
        return "".join(self.pieces[i % size] for i in range(start, start + count))

    def generated_pieces(self) -> tuple[str, ...]:
        return self.pieces


def _pieces(backend: Any) -> tuple[str, ...]:
    def tokens(text: str) -> int:
        return len(backend.encode(text, add_special_tokens=False).ids)

    words = tuple(f" {word}" for word in GENERATED.split() if tokens(f" {word}") == 1)
    if words and tokens("".join(words) * 3) == 3 * len(words):
        return words
    ids = backend.encode(GENERATED, add_special_tokens=False).ids
    return tuple(backend.decode([token]) for token in ids) or tuple(GENERATED)


BYTES: Final = Bytes()
