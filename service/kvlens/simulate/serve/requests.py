"""A request body of ``kvlens simulate serve``, parsed and checked as vLLM 0.33 checks it; and the
answers of ``/tokenize`` and ``/detokenize``, which need nothing but the body. Pure functions of
the served model and the body, so the server may run them on a thread (:mod:`.api` does for
large bodies and for every tokenizing request).

Each is bounded before its work: a token-id prompt is measured against the context before its ids
are read, a text against it before it is tokenized, ``/tokenize``'s text and ``/detokenize``'s ids
against :data:`MAX_TOKEN_IDS`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from kvlens.simulate.serve import tokenizer

MAX_PROMPTS: Final = 1024  # prompts in one completions batch
# /tokenize's text and /detokenize's ids: at most this many tokens. Their answers are then at
# most about 4 MB (ids of text: 4 bytes each) and 9.4 MB ("<|31999|>": 9 bytes an id), and the
# work a few hundred ms of a core; a context of 1M tokens still fits.
MAX_TOKEN_IDS: Final = 1 << 20


@dataclass(frozen=True)
class Served:
    model: str = "simulated"
    max_model_len: int = 32_768
    vocab_size: int = tokenizer.DEFAULT_VOCAB_SIZE
    # the bytes of tokenizer.py, or --tokenizer DIR's (its vocab_size is then vocab_size)
    codec: tokenizer.Tokenizer = tokenizer.BYTES
    loras: tuple[str, ...] = ()  # LoRA adapters served beside the model (--lora-modules)


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass
class Asked:
    """What one generation request asked for, once checked."""

    prompts: list[list[int]]
    outputs: list[int]
    stream: bool
    include_usage: bool
    request_id: str
    cache_salt: str | None = None  # vLLM's request field, checked as vLLM 0.33 checks it
    lora: str | None = None  # the adapter asked for as the model, or None: the base model


def parse(served: Served, raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ApiError(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.model and model not in served.loras:
        raise ApiError(f"The model `{model}` does not exist.", "model", status=404)
    return body


def completion(served: Served, body: dict[str, Any], request_id: str | None) -> Asked:
    prompts = _prompts(served, body.get("prompt"))
    for name in ("echo", "suffix"):
        if body.get(name):
            raise ApiError(f"{name} is not modelled by kvlens simulate serve", name)
    asked = integer(body, "max_tokens", 16, low=1)
    return _asked(served, request_id, body, prompts, asked, "cmpl")


def chat(served: Served, body: dict[str, Any], request_id: str | None) -> Asked:
    ids = _encode(served, _chat_text(body), "messages")
    asked_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = integer(body, asked_name, None, low=1)
    return _asked(served, request_id, body, [ids], asked, "chatcmpl")


def tokenize(served: Served, raw: bytes) -> bytes:
    """``/tokenize``'s answer; a text past MAX_TOKEN_IDS tokens is refused before it is tokenized."""
    body = parse(served, raw)
    if "messages" in body:
        text, param = _chat_text(body), "messages"
    else:
        prompt, param = body.get("prompt"), "prompt"
        if type(prompt) is not str:
            raise ApiError("prompt must be a string", "prompt")
        text = prompt

    def within(count: int) -> None:
        if count > MAX_TOKEN_IDS:
            raise ApiError(
                f"/tokenize takes a text of at most {MAX_TOKEN_IDS} tokens; this one has {count}", param
            )

    ids = _bounded(served, text, param == "prompt", within)
    answer = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids, "token_strs": None}
    return orjson.dumps(answer)


def detokenize(served: Served, raw: bytes) -> bytes:
    """``/detokenize``'s answer; more than MAX_TOKEN_IDS ids are refused before they are read."""
    ids = parse(served, raw).get("tokens")
    if type(ids) is list and len(ids) > MAX_TOKEN_IDS:
        raise ApiError(
            f"/detokenize takes at most {MAX_TOKEN_IDS} token ids; this request has {len(ids)}", "tokens"
        )
    return orjson.dumps({"prompt": served.codec.decode(_token_ids(served, ids, "tokens"))})


def _asked(
    served: Served,
    header: str | None,
    body: dict[str, Any],
    prompts: list[list[int]],
    asked: int | None,
    prefix: str,
) -> Asked:
    if integer(body, "n", 1, low=1) > 1:
        raise ApiError("n > 1 is not modelled by kvlens simulate serve (send n requests)", "n")
    if body.get("logprobs") not in (None, False) or body.get("use_beam_search"):
        raise ApiError("logprobs and beam search are not modelled by kvlens simulate serve", "logprobs")
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(options, dict):
            raise ApiError("stream_options must be an object", "stream_options")
    include_usage = boolean(options or {}, "include_usage", False)
    boolean(body, "ignore_eos", False)
    user = body.get("user")
    if user is not None and type(user) is not str:
        raise ApiError("user must be a string", "user")
    limit = served.max_model_len
    outputs = []
    for ids in prompts:
        fits(served, len(ids), "prompt" if prefix == "cmpl" else "messages")
        outputs.append(min(asked, limit - len(ids)) if asked is not None else limit - len(ids))
    minimum = integer(body, "min_tokens", 0, low=0)
    if asked is not None and minimum > asked:
        raise ApiError(
            f"min_tokens ({minimum}) must be less than or equal to max_tokens ({asked})", "min_tokens"
        )
    request_id = f"{prefix}-{header or uuid.uuid4().hex}"
    lora = body.get("model") if body.get("model") in served.loras else None
    return Asked(prompts, outputs, stream, include_usage, request_id, cache_salt(body), lora)


MAX_SALT_CHARS: Final = 128
_SALT_FORBIDDEN: Final = frozenset("@/\\\0")


def cache_salt(body: dict[str, Any]) -> str | None:
    """The body's ``cache_salt``, refused as vLLM 0.33's ``validate_cache_salt`` refuses it: not a
    string, empty, over MAX_SALT_CHARS characters, or holding ``@ / \\`` or NUL. The message never
    holds the salt (it is a tenant's secret)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if type(salt) is not str or not salt:
        raise ApiError("cache_salt must be a non-empty string", "cache_salt")
    if len(salt) > MAX_SALT_CHARS or not _SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(
            f"cache_salt must be at most {MAX_SALT_CHARS} characters, without '@', '/', '\\' or NUL",
            "cache_salt",
        )
    return salt


def fits(served: Served, tokens: int, param: str) -> None:
    limit = served.max_model_len
    if tokens >= limit:
        raise ApiError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{tokens} input tokens. Please reduce the length of the input messages.",
            param,
        )


def _encode(served: Served, text: str, param: str) -> list[int]:
    """The prompt's tokens; one past the context is refused (by the byte tokenizer before they
    are made). A completions prompt gets what the tokenizer's post-processor adds (a BOS), as
    vLLM gives it; a rendered chat has its special tokens already."""
    return _bounded(served, text, param == "prompt", lambda count: fits(served, count, param))


def _bounded(served: Served, text: str, special: bool, check: Callable[[int], None]) -> list[int]:
    """``text``'s ids once ``check`` has passed their count: the byte tokenizer counts without
    building them (:func:`tokenizer.count`); another's count is its encoding, made once (the body
    is bounded by MAX_BODY_BYTES, and a byte-level tokenizer makes at most a token a byte)."""
    if isinstance(served.codec, tokenizer.Bytes):
        check(tokenizer.count(text))
        return tokenizer.encode(text)
    ids = served.codec.encode(text, special)
    check(len(ids))
    return ids


def _prompt_ids(served: Served, ids: list[Any], name: str) -> list[int]:
    """A token-id prompt, measured against the context before its ids are read (8M ids took
    0.78 s to check, then were refused for their number)."""
    fits(served, len(ids), "prompt")
    return _token_ids(served, ids, name)


def _prompts(served: Served, prompt: Any) -> list[list[int]]:
    if type(prompt) is str:
        prompts = [_encode(served, prompt, "prompt")]
    elif type(prompt) is list and prompt and type(prompt[0]) is int:
        prompts = [_prompt_ids(served, prompt, "prompt")]
    elif type(prompt) is list and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        prompts = []
        for index, item in enumerate(prompt):
            if type(item) is str:
                prompts.append(_encode(served, item, "prompt"))
            elif type(item) is list:
                prompts.append(_prompt_ids(served, item, f"prompt[{index}]"))
            else:
                raise ApiError(f"prompt[{index}] must be a string or a list of token ids", "prompt")
    else:
        raise ApiError("prompt must be a string, a list of token ids, or a list of either", "prompt")
    if any(not ids for ids in prompts):
        raise ApiError("The decoder prompt cannot be empty", "prompt")
    return prompts


def _token_ids(served: Served, value: Any, name: str) -> list[int]:
    # Whole-list builtins (C loops) first; the first bad id is looked for only when there is one.
    if type(value) is not list or not set(map(type, value)) <= {int}:
        raise ApiError(f"{name} must be a list of token ids", name)
    vocab = served.vocab_size
    if value and not (min(value) >= 0 and max(value) < vocab):
        token = next(token for token in value if not 0 <= token < vocab)
        raise ApiError(f"Token id {token} in {name} is out of vocabulary (0 to {vocab - 1})", name)
    return value


def _chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or type(message.get("role")) is not str:
            raise ApiError(f"messages[{index}] must be an object with a role", "messages")
        rendered.append((message["role"], _content(message.get("content"), index)))
    add = boolean(body, "add_generation_prompt", True)
    return tokenizer.chat_prompt(rendered, add_generation_prompt=add)


def integer(body: dict[str, Any], name: str, default: int | None, *, low: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int or value < low:
        raise ApiError(f"{name} must be an integer >= {low}", name)
    return value


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise ApiError(f"{name} must be true or false", name)
    return value


def _content(content: Any, index: int) -> str:
    if type(content) is str:
        return content
    if content is None:
        return ""
    if type(content) is list:
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or type(part.get("text")) is not str:
                raise ApiError(f"messages[{index}].content: only text parts are modelled", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ApiError(f"messages[{index}].content must be a string or a list of text parts", "messages")
